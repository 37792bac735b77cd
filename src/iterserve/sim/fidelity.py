"""`iterserve bench fidelity`: one workload through the real engine and through the simulator
priced by a cost profile, side by side, with the simulator's error on every figure.

Both runs take the same engine settings, the same requests and the same arrival times; the
simulated engine gets the real one's KV pool size, so where their step times agree they
admit, chunk and preempt alike (the step and preemption counts of both are printed to show
it). Arrivals must be open-loop (Poisson, gamma or a trace): a closed loop's arrivals
depend on when earlier requests finished, which is what is being compared.

    iterserve bench fidelity --workload azure-conv --time-scale 2 --num-requests 100 \
        [--cost-profile PROFILE.json] [--result-json out.json]

Without --cost-profile the engine is profiled first (`iterserve bench profile`'s default
grid, about a minute and a half on the bundled model), right before the real run: the same
settings, and the same spell of a machine whose speed drifts over minutes.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

from iterserve.bench.metrics import BenchMetrics
from iterserve.core.outputs import SchedulerOutput
from iterserve.sim.cost_profile import ProfiledCostModel, StepFeatures

# (label, how to read it off BenchMetrics); latencies in ms.
FIGURES: list[tuple[str, Any]] = [
    ("output tok/s", lambda m: m.throughput.output_throughput),
    ("req/s", lambda m: m.throughput.request_throughput),
    ("TTFT p50", lambda m: m.latency.ttft and m.latency.ttft.median),
    ("TTFT p90", lambda m: m.latency.ttft and m.latency.ttft.p90),
    ("TTFT p99", lambda m: m.latency.ttft and m.latency.ttft.p99),
    ("TBT p50", lambda m: m.latency.itl and m.latency.itl.median),
    ("TBT p99", lambda m: m.latency.itl and m.latency.itl.p99),
    ("E2E p50", lambda m: m.latency.e2el and m.latency.e2el.median),
    ("E2E p99", lambda m: m.latency.e2el and m.latency.e2el.p99),
    ("queue p50", lambda m: m.latency.queue and m.latency.queue.median),
    ("queue p99", lambda m: m.latency.queue and m.latency.queue.p99),
]


class StepLog:
    """An engine whose steps are timed (whole `LLMEngine.step` calls, as a profile times
    them) and kept with what they ran; everything else is the engine's own. Only the plan
    is kept during the run: pricing it waits until the run is over."""

    def __init__(self, engine: Any) -> None:
        self._engine = engine
        self.steps: list[tuple[SchedulerOutput, float]] = []

    def __getattr__(self, name: str) -> Any:
        return getattr(self._engine, name)

    def step(self, no_more_arrivals: bool = False) -> Any:
        start = time.perf_counter()
        step = self._engine.step(no_more_arrivals)
        seconds = time.perf_counter() - start
        if step.scheduled is not None and step.scheduled.num_batched_tokens:
            self.steps.append((step.scheduled, seconds))
        return step


def step_errors(
    steps: list[tuple[SchedulerOutput, float]], model: ProfiledCostModel
) -> list[dict[str, Any]]:
    """The cost model against the real run's own steps, by kind: how much of a fidelity
    error is the price of a step (and the machine's drift since the profile) rather than
    the scheduling around it."""
    kinds: dict[str, list[tuple[float, float]]] = {}
    for scheduled, seconds in steps:
        features = StepFeatures.of(scheduled)
        if features.prefill_tokens == 0:
            kind = "decode, 1-4 rows" if features.decode_rows <= 4 else "decode, 5+ rows"
        else:
            kind = "prefill" if features.decode_rows == 0 else "prefill + decode"
        kinds.setdefault(kind, []).append((model.time_of(features), seconds))
    rows = []
    for kind, pairs in sorted(kinds.items()):
        predicted = sum(p for p, _ in pairs)
        real = sum(r for _, r in pairs)
        rows.append({"steps": kind, "count": len(pairs), "real_s": real, "predicted_s": predicted,
                     "error": predicted / real - 1})  # fmt: skip
    return rows


@dataclass
class Side:
    metrics: BenchMetrics
    steps: int
    preemptions: int


def compare(real: Side, simulated: Side) -> list[dict[str, Any]]:
    """Each figure on both sides and the simulator's relative error."""
    rows = []
    for label, read in FIGURES:
        a, b = read(real.metrics), read(simulated.metrics)
        error = (b - a) / a if a and b is not None else None
        rows.append({"figure": label, "real": a, "simulated": b, "error": error})
    for label, a, b in [
        ("steps", real.steps, simulated.steps),
        ("preemptions", real.preemptions, simulated.preemptions),
    ]:
        rows.append({"figure": label, "real": a, "simulated": b, "error": None})
    return rows


def format_rows(rows: list[dict[str, Any]]) -> str:
    lines = [f"{'':14s} {'real':>10s} {'simulated':>10s} {'error':>8s}"]
    for row in rows:
        real, sim, error = row["real"], row["simulated"], row["error"]
        lines.append(
            f"{row['figure']:14s} {_num(real):>10s} {_num(sim):>10s} "
            f"{'' if error is None else f'{100 * error:+.1f}%':>8s}"
        )
    return "\n".join(lines)


def _num(value: float | None) -> str:
    if value is None:
        return "-"
    return f"{value:.0f}" if abs(value) >= 100 or float(value).is_integer() else f"{value:.2f}"
