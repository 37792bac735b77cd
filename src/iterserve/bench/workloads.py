"""Seeded, reproducible workloads whose prompts are real token ids of the served model.

Prompt lengths are exact because prompts *are* token ids: each is drawn from the tokenizer's
ordinary vocabulary (no special tokens) and, by default, sent to the server as a token-id
list, which the OpenAI completions API accepts. With `prompt_format="text"` each prompt is
also turned into text that re-tokenizes to exactly those ids (for servers that only take
text), by decoding and re-encoding until the two agree.

Workloads:
  synthetic        fixed / uniform / lognormal prompt and output lengths
  azure-conv       lengths and arrival times from a trace (see trace.py)
  azure-lengths    (prompt, output) lengths drawn from that trace, as many requests as
                   asked, arrivals from --arrival; prompts are windows of one shared pool
                   of random ids, so a million of them fit in memory (`iterserve simulate`)
  shared-prefix    a common system prompt of `prefix_len` tokens before every prompt
  mixed-chat-docs  short interactive chats plus long documents in the batch lane
  copy-edit        chat requests to edit code or prose: answers repeat their prompts
                   (real text, through the model's chat template; for speculation)
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np

from iterserve.bench.copy_texts import INSTRUCTIONS, PASSAGES
from iterserve.bench.tokenizer import ordinary_token_ids
from iterserve.bench.trace import load_trace

WORKLOADS = (
    "synthetic",
    "azure-conv",
    "azure-lengths",
    "shared-prefix",
    "mixed-chat-docs",
    "copy-edit",
)
LENGTH_DISTS = ("fixed", "uniform", "lognormal")


class PoolWindow(Sequence[int]):
    """Tokens `start:stop` of a pool shared by many prompts, not copied until asked for."""

    def __init__(self, pool: list[int], start: int, stop: int) -> None:
        self.pool, self.start, self.stop = pool, start, stop

    def __len__(self) -> int:
        return self.stop - self.start

    def __getitem__(self, index):  # type: ignore[no-untyped-def]
        if isinstance(index, slice):  # a slice of the pool, not of a copy of the window
            start, stop, step = index.indices(len(self))
            return self.pool[self.start + start : self.start + stop : step]
        return self.tolist()[index]

    def tolist(self) -> list[int]:
        return self.pool[self.start : self.stop]


@dataclass
class WorkloadRequest:
    prompt_token_ids: Sequence[int]  # a list, or a window of a shared pool (azure-lengths)
    output_len: int
    lane: str = "interactive"
    prompt_text: str | None = None  # set in text mode; re-tokenizes to prompt_token_ids
    arrival: float | None = None  # seconds after the first request, when the trace says

    @property
    def prompt_len(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def prompt(self) -> str | list[int]:
        return self.prompt_text if self.prompt_text is not None else self.token_ids()

    def token_ids(self) -> list[int]:
        ids = self.prompt_token_ids
        return ids.tolist() if isinstance(ids, PoolWindow) else list(ids)

    def head(self, n: int) -> list[int]:
        """The prompt's first `n` token ids (all of them if it is shorter)."""
        return list(self.prompt_token_ids[:n])


@dataclass
class WorkloadSpec:
    """Everything that determines a workload; the same spec and seed give the same requests."""

    name: str = "synthetic"
    num_requests: int = 100
    input_len: int = 128  # synthetic prompt; shared-prefix suffix; mixed-chat-docs chat prompt
    output_len: int = 128
    length_dist: str = "fixed"
    range_ratio: float = 0.5  # uniform: lengths in [len * (1 - r), len * (1 + r)]
    lognormal_sigma: float = 0.5  # lognormal: sigma of log length; the mean stays `len`
    max_prompt_len: int | None = None  # clip (trace and lognormal tails)
    max_output_len: int | None = None
    prefix_len: int = 256
    num_prefixes: int = 1
    doc_fraction: float = 0.2
    doc_len: int = 1024
    doc_output_len: int = 32
    trace: str | None = None  # CSV path; None: the bundled Azure conversation trace
    time_scale: float = 1.0
    prompt_format: str = "ids"  # ids | text
    seed: int = 0


@dataclass
class Workload:
    name: str
    requests: list[WorkloadRequest]
    spec: WorkloadSpec = field(default_factory=WorkloadSpec)
    # A short request of its own ids, run before timing starts: it pays one-off costs
    # (lazy init, first kernels) without warming the prefix cache for any measured prompt.
    warmup: WorkloadRequest | None = None

    @property
    def has_arrival_times(self) -> bool:
        return bool(self.requests) and all(r.arrival is not None for r in self.requests)

    def summary(self) -> dict[str, Any]:
        prompts = [r.prompt_len for r in self.requests]
        outputs = [r.output_len for r in self.requests]
        return {
            "name": self.name,
            "num_requests": len(self.requests),
            "mean_prompt_len": float(np.mean(prompts)) if prompts else 0.0,
            "mean_output_len": float(np.mean(outputs)) if outputs else 0.0,
            "lanes": sorted({r.lane for r in self.requests}),
            "spec": asdict(self.spec),
        }


def sample_lengths(
    rng: np.random.Generator,
    n: int,
    mean: int,
    dist: str,
    range_ratio: float = 0.5,
    sigma: float = 0.5,
    cap: int | None = None,
) -> list[int]:
    """n lengths >= 1 with the given mean (before clipping at `cap`)."""
    if mean < 1:
        raise ValueError(f"lengths must be at least 1, got {mean}")
    if dist == "fixed":
        values = np.full(n, mean)
    elif dist == "uniform":
        lo = max(1, round(mean * (1 - range_ratio)))
        hi = max(lo, round(mean * (1 + range_ratio)))
        values = rng.integers(lo, hi + 1, size=n)
    elif dist == "lognormal":
        # mu chosen so the mean (not the median) is `mean`: E[X] = exp(mu + sigma^2 / 2).
        values = np.rint(rng.lognormal(math.log(mean) - sigma**2 / 2, sigma, size=n))
    else:
        raise ValueError(f"length distribution must be one of {LENGTH_DISTS}, got {dist!r}")
    values = np.maximum(values, 1)
    if cap is not None:
        values = np.minimum(values, cap)
    return [int(v) for v in values]


class _Prompts:
    """Draws prompts of exact token length from the tokenizer's ordinary vocabulary."""

    def __init__(self, tokenizer: Any, rng: np.random.Generator, as_text: bool) -> None:
        self.tokenizer = tokenizer
        self.rng = rng
        self.pool = np.asarray(ordinary_token_ids(tokenizer))
        self.as_text = as_text

    def ids(self, n: int) -> list[int]:
        return self.rng.choice(self.pool, size=n).tolist()

    def request(self, ids: list[int], output_len: int, **kw: Any) -> WorkloadRequest:
        text = None
        if self.as_text:
            ids, text = self.exact_text(ids)
        return WorkloadRequest(ids, output_len, prompt_text=text, **kw)

    def exact_text(self, ids: list[int], tries: int = 50) -> tuple[list[int], str]:
        """Text that re-tokenizes to exactly len(ids) tokens (and to the returned ids).

        Random ids rarely survive decode -> encode unchanged (byte fragments merge); feeding
        the re-encoded ids back, trimmed or topped up to length, reaches a fixpoint quickly.
        """
        target = len(ids)
        for _ in range(tries):
            text = self.tokenizer.decode(ids)
            again = self.tokenizer.encode(text, add_special_tokens=False)
            if again == ids:
                return ids, text
            ids = again[:target] + self.ids(max(0, target - len(again)))
        raise ValueError(f"no text re-tokenizes to {target} tokens; use --prompt-format ids")


def build_workload(spec: WorkloadSpec, tokenizer: Any) -> Workload:
    if spec.name not in WORKLOADS:
        raise ValueError(f"workload must be one of {WORKLOADS}, got {spec.name!r}")
    if spec.prompt_format not in ("ids", "text"):
        raise ValueError(f"--prompt-format must be ids or text, got {spec.prompt_format!r}")
    rng = np.random.default_rng(spec.seed)
    prompts = _Prompts(tokenizer, rng, spec.prompt_format == "text")
    builder = {
        "synthetic": _synthetic,
        "azure-conv": _azure_conv,
        "azure-lengths": _azure_lengths,
        "shared-prefix": _shared_prefix,
        "mixed-chat-docs": _mixed_chat_docs,
        "copy-edit": _copy_edit,
    }[spec.name]
    requests = builder(spec, rng, prompts)
    warmup = prompts.request(prompts.ids(16), 4)  # drawn last: the requests stay as they were
    return Workload(spec.name, requests, spec, warmup)


def _lengths(spec: WorkloadSpec, rng: np.random.Generator, n: int, mean: int, cap: int | None):
    return sample_lengths(
        rng, n, mean, spec.length_dist, spec.range_ratio, spec.lognormal_sigma, cap
    )


def _synthetic(spec: WorkloadSpec, rng: np.random.Generator, p: _Prompts) -> list[WorkloadRequest]:
    n = spec.num_requests
    ins = _lengths(spec, rng, n, spec.input_len, spec.max_prompt_len)
    outs = _lengths(spec, rng, n, spec.output_len, spec.max_output_len)
    return [p.request(p.ids(i), o) for i, o in zip(ins, outs, strict=True)]


def _azure_conv(spec: WorkloadSpec, rng: np.random.Generator, p: _Prompts) -> list[WorkloadRequest]:
    rows = load_trace(
        spec.trace, spec.num_requests, spec.time_scale, spec.max_prompt_len, spec.max_output_len
    )
    return [p.request(p.ids(row.prompt_len), row.output_len, arrival=row.arrival) for row in rows]


def _azure_lengths(
    spec: WorkloadSpec, rng: np.random.Generator, p: _Prompts
) -> list[WorkloadRequest]:
    if p.as_text:
        raise ValueError("azure-lengths prompts are token ids; use --prompt-format ids")
    rows = load_trace(spec.trace, None, 1.0, spec.max_prompt_len, spec.max_output_len)
    picks = rng.integers(len(rows), size=spec.num_requests)
    longest = max(row.prompt_len for row in rows)
    # Each prompt is a window at a random start of one pool of random ids, copied out when
    # it is sent (a list apiece would need ~9 GB for a million 1k-token prompts): distinct
    # prompts almost surely, no two alike in their first block unless they start alike.
    pool = p.ids(max(1 << 20, 4 * longest))
    starts = rng.integers(len(pool) - longest, size=spec.num_requests)
    return [
        WorkloadRequest(PoolWindow(pool, start, start + rows[i].prompt_len), rows[i].output_len)
        for i, start in zip(picks.tolist(), starts.tolist(), strict=True)
    ]


def _shared_prefix(
    spec: WorkloadSpec, rng: np.random.Generator, p: _Prompts
) -> list[WorkloadRequest]:
    if spec.num_prefixes < 1:
        raise ValueError("--num-prefixes must be at least 1")
    prefixes = [p.ids(spec.prefix_len) for _ in range(spec.num_prefixes)]
    n = spec.num_requests
    suffixes = _lengths(spec, rng, n, spec.input_len, spec.max_prompt_len)
    outs = _lengths(spec, rng, n, spec.output_len, spec.max_output_len)
    return [
        p.request(prefixes[i % len(prefixes)] + p.ids(s), o)
        for i, (s, o) in enumerate(zip(suffixes, outs, strict=True))
    ]


def _mixed_chat_docs(
    spec: WorkloadSpec, rng: np.random.Generator, p: _Prompts
) -> list[WorkloadRequest]:
    """Chats (interactive lane) interleaved with long documents (batch lane).

    An exact number of documents, round(n * doc_fraction), at seeded random positions: the
    mix is the same in every run, which a comparison of scheduling policies needs.
    """
    if not 0.0 <= spec.doc_fraction <= 1.0:
        raise ValueError("--doc-fraction must be in [0, 1]")
    n = spec.num_requests
    num_docs = round(n * spec.doc_fraction)
    is_doc = np.zeros(n, dtype=bool)
    is_doc[rng.choice(n, size=num_docs, replace=False)] = True
    chat_in = iter(_lengths(spec, rng, n - num_docs, spec.input_len, spec.max_prompt_len))
    chat_out = iter(_lengths(spec, rng, n - num_docs, spec.output_len, spec.max_output_len))
    doc_in = iter(_lengths(spec, rng, num_docs, spec.doc_len, spec.max_prompt_len))
    doc_out = iter(_lengths(spec, rng, num_docs, spec.doc_output_len, spec.max_output_len))
    return [
        p.request(p.ids(next(doc_in)), next(doc_out), lane="batch")
        if doc
        else p.request(p.ids(next(chat_in)), next(chat_out), lane="interactive")
        for doc in is_doc
    ]


def _copy_edit(spec: WorkloadSpec, rng: np.random.Generator, p: _Prompts) -> list[WorkloadRequest]:
    """An edit request (seeded pick of instruction and passage) in the model's chat
    template; `output_len` tokens of answer each (lengths as for synthetic)."""
    outs = _lengths(spec, rng, spec.num_requests, spec.output_len, spec.max_output_len)
    requests = []
    for out in outs:
        ask = INSTRUCTIONS[rng.integers(len(INSTRUCTIONS))]
        passage = PASSAGES[rng.integers(len(PASSAGES))]
        content = f"{ask}\n\n```\n{passage}```"
        if getattr(p.tokenizer, "chat_template", None):
            text = p.tokenizer.apply_chat_template(
                [{"role": "user", "content": content}], tokenize=False, add_generation_prompt=True
            )
        else:
            text = f"{content}\n\nAnswer:\n"
        ids = p.tokenizer.encode(text, add_special_tokens=False)
        requests.append(WorkloadRequest(ids, int(out), prompt_text=text if p.as_text else None))
    return requests
