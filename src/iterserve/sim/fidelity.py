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

import argparse
import json
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from iterserve.bench.metrics import BenchMetrics, compute_metrics
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


def add_fidelity_parser(runners: argparse._SubParsersAction) -> None:
    from iterserve.bench.args import add_arrival_args, add_workload_args
    from iterserve.config import add_engine_args

    p = runners.add_parser(
        "fidelity",
        help="run a workload for real and in the simulator (cost profile), and compare",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument(
        "--cost-profile",
        default=None,
        help="price steps by this profile; default: profile the engine first (~1.5 minutes)",
    )
    p.add_argument("--result-json", default=None)
    add_workload_args(p, with_seed=False)
    add_arrival_args(p)
    add_engine_args(p)
    p.set_defaults(func=_run_fidelity)


def _run_fidelity(args: argparse.Namespace) -> int:
    from iterserve.bench.args import arrival_spec, workload_spec
    from iterserve.bench.arrivals import arrival_offsets
    from iterserve.bench.offline import OfflineOptions, run_engine, warm_up
    from iterserve.bench.tokenizer import load_tokenizer
    from iterserve.bench.workloads import build_workload
    from iterserve.config import engine_config_from_args
    from iterserve.engine.llm_engine import LLMEngine
    from iterserve.sim.cost_profile import CostProfile
    from iterserve.sim.fleet import simulate_fleet
    from iterserve.sim.profile import ProfileGrid, profile_engine

    config = engine_config_from_args(args)
    arrival = arrival_spec(args)
    if arrival.max_concurrency is not None or arrival.process == "closed":
        raise ValueError("bench fidelity needs open-loop arrivals (poisson, gamma or trace)")
    workload = build_workload(workload_spec(args), load_tokenizer(config.model))
    trace = [r.arrival or 0.0 for r in workload.requests] if workload.has_arrival_times else None
    offsets = arrival_offsets(arrival, len(workload.requests), config.seed, trace)

    engine = LLMEngine(config)
    if args.cost_profile:
        profile = CostProfile.load(args.cost_profile)
    else:
        # Profiled here and now: the same engine settings, and the same spell of a machine
        # whose speed drifts by 10-20% over minutes.
        started = time.perf_counter()
        grid = ProfileGrid().fitting(config, engine.max_request_tokens())
        profile = profile_engine(engine, grid, config.seed)
        print(f"profiled the engine in {time.perf_counter() - started:.0f}s")
    options = OfflineOptions(progress=False)
    warm_up(engine, workload, options)
    engine.reset_prefix_cache()
    steps, preemptions = engine.stats.num_steps, engine.scheduler.num_preemptions
    started = time.perf_counter()
    logged = StepLog(engine)
    result = run_engine(logged, workload, offsets, None, options)
    real_seconds = time.perf_counter() - started
    real = Side(
        compute_metrics(result.records),
        engine.stats.num_steps - steps,
        engine.scheduler.num_preemptions - preemptions,
    )
    started = time.perf_counter()
    records, fleet = simulate_fleet(
        config,
        workload,
        offsets,
        "cpu-2core",  # hardware and model presets: unused, the profile and pool size decide
        "smollm2-135m",
        profile=profile,
        num_kv_blocks=engine.scheduler.kv_cache_stats().num_blocks,
    )
    sim_seconds = time.perf_counter() - started
    replica = fleet[0]
    simulated = Side(
        compute_metrics(records), replica.engine.stats.num_steps, replica.scheduler.num_preemptions
    )
    rows = compare(real, simulated)
    print(f"workload: {workload.summary()['name']}, {len(workload.requests)} requests, "
          f"{arrival.describe()}")  # fmt: skip
    print(f"profile: {profile.about.get('model')} on {profile.about.get('cpu')}, "
          f"{profile.about.get('date')}{'' if profile.measured else ' (NOT measured)'}")  # fmt: skip
    print(format_rows(rows))
    print(f"real run {real_seconds:.0f}s, simulated in {sim_seconds:.1f}s")
    steps_priced = step_errors(logged.steps, ProfiledCostModel(profile))
    print("the profile's price of the real run's own steps:")
    for row in steps_priced:
        print(f"  {row['steps']:18s} {row['count']:6d} steps, real {row['real_s']:6.1f}s, "
              f"priced {row['predicted_s']:6.1f}s ({100 * row['error']:+.1f}%)")  # fmt: skip
    if args.result_json:
        body = {
            "workload": workload.summary(),
            "arrivals": arrival.describe(),
            "profile": profile.about,
            "rows": rows,
            "step_errors": steps_priced,
        }
        Path(args.result_json).write_text(json.dumps(body, indent=2))
        print(f"wrote {args.result_json}")
    return 0
