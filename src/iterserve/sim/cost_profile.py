"""Step costs measured on real hardware: a profile of the engine's steps, and a cost model
that prices a simulated step by interpolating it.

The roofline model (executor.py) knows peaks, not this engine: on the 2-core CPU it priced
a decode step at under half its real cost. A profile instead holds what `iterserve bench
profile` timed, whole engine steps (scheduling, forward, sampling, detokenizing), on two
grids:

  decode   rows x context: steps where every sequence decodes (one query row each, or
           1 + k with speculation) over `context` tokens each
  prefill  tokens x prefix: steps computing one prompt chunk of `tokens` tokens after a
           cached `prefix`

A step is priced from its features: its decoding sequences' query rows and mean context
give the decode part, its prefill chunks' tokens and (token-weighted) mean prefix the
prefill part, each by bilinear interpolation on its grid (linear beyond the edges). A step
that mixes both is priced as a chunk of all its query rows (decode rows cost what a chunk's
rows cost: the projections dominate and run them together) plus the decodes' attention
beyond the decode grid's shortest context. At a profiled point the model returns the
profiled time exactly; between points and for mixed steps it is an estimate, which
`iterserve bench fidelity` checks against real runs.

Profiles are JSON with what they were measured on (model, weights, device, threads, engine
version, date); `about.measured: false` marks one that was not measured (none ships: the
GPU presets are priced by the roofline model itself, and the report says so).
"""

from __future__ import annotations

import bisect
import json
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from iterserve.core.outputs import ScheduledSeq, SchedulerOutput
from iterserve.sim.decode_cohort import SteadyDecodes, steady_part
from iterserve.sim.executor import CostModel

FORMAT_VERSION = 1
# Profiles that ship with iterserve, one file per (hardware preset, model preset).
SHIPPED = Path(__file__).resolve().parent / "profiles"


@dataclass(frozen=True)
class Grid:
    """Step seconds at every (x, y) of two ascending axes: seconds[i][j] at (xs[i], ys[j])."""

    xs: list[float]
    ys: list[float]
    seconds: list[list[float]]

    def __post_init__(self) -> None:
        if not self.xs or not self.ys:
            raise ValueError("a profile grid needs at least one point on each axis")
        if any(b <= a for a, b in zip(self.xs, self.xs[1:], strict=False)) or any(
            b <= a for a, b in zip(self.ys, self.ys[1:], strict=False)
        ):
            raise ValueError("profile grid axes must be strictly ascending")
        if len(self.seconds) != len(self.xs) or any(len(r) != len(self.ys) for r in self.seconds):
            raise ValueError("profile grid seconds must be len(xs) rows of len(ys)")

    def at(self, x: float, y: float) -> float:
        """Bilinear interpolation; linear extrapolation from the nearest cell outside."""
        i, tx = _segment(self.xs, x)
        j, ty = _segment(self.ys, y)
        s = self.seconds

        def row(r: int) -> float:
            if len(self.ys) == 1:
                return s[r][0]
            return s[r][j] + ty * (s[r][j + 1] - s[r][j])

        if len(self.xs) == 1:
            return row(0)
        return row(i) + tx * (row(i + 1) - row(i))


def _segment(axis: list[float], v: float) -> tuple[int, float]:
    """The cell [axis[i], axis[i+1]] that holds v (the first or last one outside the axis),
    and v's position in it (below 0 or above 1 when extrapolating)."""
    if len(axis) == 1:
        return 0, 0.0
    i = min(max(bisect.bisect_right(axis, v) - 1, 0), len(axis) - 2)
    return i, (v - axis[i]) / (axis[i + 1] - axis[i])


def per_kv_token(decode: Grid) -> Grid:
    """The decode grid with its longer contexts re-derived from the shortest one plus one
    cost per KV token read, fitted over every batch size (least squares: the big batches,
    whose extra context is thousands of tokens, weigh most). Decode attention streams K/V,
    so its cost grows with the tokens read; a few requests' own differences between two
    contexts are within this machine's step-to-step noise, and extrapolating them to long
    contexts made small decode steps up to 1.6x too slow (`iterserve bench fidelity`)."""
    c0 = decode.ys[0]
    num = den = 0.0
    for b, row in zip(decode.xs, decode.seconds, strict=True):
        for c, t in zip(decode.ys[1:], row[1:], strict=True):
            tokens = b * (c - c0)
            num += tokens * (t - row[0])
            den += tokens * tokens
    per_token = max(0.0, num / den) if den else 0.0
    seconds = [
        [row[0] + per_token * b * (c - c0) for c in decode.ys]
        for b, row in zip(decode.xs, decode.seconds, strict=True)
    ]
    return Grid(decode.xs, decode.ys, seconds)


@dataclass(frozen=True)
class StepFeatures:
    """What a step's time is read off the profile by."""

    decode_rows: int  # query rows of decoding sequences (1 + drafts each)
    decode_context: float  # their mean context (tokens each attends over)
    prefill_tokens: int  # prompt tokens computed, over all prefill chunks
    prefill_prefix: float  # tokens already cached before them, mean per prefill token

    @classmethod
    def of(cls, scheduled: SchedulerOutput) -> StepFeatures:
        return cls.of_parts(steady_part(scheduled), scheduled.seqs)

    @classmethod
    def of_parts(cls, steady: SteadyDecodes | None, seqs: Sequence[ScheduledSeq]) -> StepFeatures:
        """The features of a step of the cohort's decodes (`steady`) and these sequences."""
        decode_rows = decode_seqs = context = 0
        if steady is not None:
            decode_rows = decode_seqs = steady.num_seqs
            context = steady.total_context
        prefill = prefix = 0
        for seq in seqs:
            guesses = len(seq.draft_token_ids)
            if seq.num_computed_tokens > 0 and seq.num_new_tokens - guesses == 1:
                decode_rows += seq.num_new_tokens
                decode_seqs += 1
                context += seq.num_computed_tokens + 1  # its own token's, drafts aside
            else:
                prefill += seq.num_new_tokens
                prefix += seq.num_new_tokens * seq.num_computed_tokens
        return cls(
            decode_rows,
            context / decode_seqs if decode_seqs else 0.0,
            prefill,
            prefix / prefill if prefill else 0.0,
        )


@dataclass
class CostProfile:
    """Step times of one model on one device, as `iterserve bench profile` measured them."""

    decode: Grid  # xs: query rows, ys: context
    prefill: Grid  # xs: prompt tokens in the step, ys: cached prefix
    # What it was measured on: model, weights, device, threads, engine version, date; and
    # whether it was measured at all (`measured: false`: a profile made some other way).
    about: dict[str, Any] = field(default_factory=dict)

    @property
    def measured(self) -> bool:
        return bool(self.about.get("measured", True))

    def to_json(self) -> str:
        body = {"format": FORMAT_VERSION, "about": self.about}
        body |= {"decode": asdict(self.decode), "prefill": asdict(self.prefill)}
        return json.dumps(body, indent=1)

    @classmethod
    def from_json(cls, text: str) -> CostProfile:
        body = json.loads(text)
        if body.get("format") != FORMAT_VERSION:
            raise ValueError(
                f"cost profile format {body.get('format')!r}, expected {FORMAT_VERSION}: "
                "profile again with `iterserve bench profile`"
            )
        return cls(Grid(**body["decode"]), Grid(**body["prefill"]), body.get("about", {}))

    def save(self, path: str | Path) -> None:
        Path(path).write_text(self.to_json())

    @classmethod
    def load(cls, path: str | Path) -> CostProfile:
        try:
            return cls.from_json(Path(path).read_text())
        except (KeyError, TypeError, json.JSONDecodeError) as err:
            raise ValueError(f"{path} is not a cost profile: {err}") from None


class ProfiledCostModel(CostModel):
    """Prices a step by interpolating a CostProfile (see the module docstring)."""

    def __init__(self, profile: CostProfile) -> None:
        self.profile = profile

    def price(self, steady: SteadyDecodes | None, seqs: Sequence[ScheduledSeq]) -> float:
        return self.time_of(StepFeatures.of_parts(steady, seqs))

    def time_of(self, f: StepFeatures) -> float:
        decode, prefill = self.profile.decode, self.profile.prefill
        if f.prefill_tokens == 0:
            return max(0.0, decode.at(f.decode_rows, f.decode_context))
        if f.decode_rows == 0:
            return max(0.0, prefill.at(f.prefill_tokens, f.prefill_prefix))
        # Decode rows ride along in the chunk's projections at its per-row cost (a 512-row
        # step is far cheaper a row than an 8-row one); what they add beyond that is their
        # attention over contexts longer than the decode grid's shortest.
        rows = prefill.at(f.prefill_tokens + f.decode_rows, f.prefill_prefix)
        shortest = decode.ys[0]
        attention = decode.at(f.decode_rows, f.decode_context) - decode.at(f.decode_rows, shortest)
        return max(0.0, rows + max(0.0, attention))


def shipped_profile(hardware: str, model: str) -> CostProfile | None:
    """The profile shipped for a hardware and model preset of the simulator, if any."""
    path = SHIPPED / f"{hardware}--{model}.json"
    return CostProfile.load(path) if path.is_file() else None
