"""`iterserve bench fidelity`'s flags and run: the comparison itself is sim/fidelity.py."""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import Any

from iterserve.bench.arrivals import ArrivalSpec, arrival_offsets
from iterserve.bench.metrics import compute_metrics
from iterserve.bench.tokenizer import load_tokenizer
from iterserve.bench.workloads import Workload, build_workload
from iterserve.cli.bench_args import arrival_spec, workload_spec
from iterserve.config import EngineConfig
from iterserve.core.outputs import SchedulerOutput
from iterserve.sim import fidelity
from iterserve.sim.cost_profile import CostProfile, ProfiledCostModel
from iterserve.sim.fidelity import Side, StepLog, compare, format_rows, step_errors
from iterserve.sim.fleet import simulate_fleet
from iterserve.sim.profile import ProfileGrid, profile_engine


def add_fidelity_parser(runners: argparse._SubParsersAction) -> None:
    from iterserve.cli.bench_args import add_arrival_args, add_workload_args
    from iterserve.config import add_engine_args

    p = runners.add_parser(
        "fidelity",
        help="run a workload for real and in the simulator (cost profile), and compare",
        description=fidelity.__doc__,
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
    # The engine (torch) loads only when the subcommand runs, not when the CLI parses.
    from iterserve.config import engine_config_from_args
    from iterserve.engine.llm_engine import LLMEngine

    config = engine_config_from_args(args)
    workload, arrival, offsets = _requests(args, config)
    engine = LLMEngine(config)
    profile = _cost_profile(args, engine, config)
    real, real_seconds, steps = _run_real(engine, workload, offsets)
    started = time.perf_counter()
    simulated = _run_simulated(config, workload, offsets, profile, engine)
    sim_seconds = time.perf_counter() - started
    rows = compare(real, simulated)
    print(f"workload: {workload.summary()['name']}, {len(workload.requests)} requests, "
          f"{arrival.describe()}")  # fmt: skip
    print(f"profile: {profile.about.get('model')} on {profile.about.get('cpu')}, "
          f"{profile.about.get('date')}{'' if profile.measured else ' (NOT measured)'}")  # fmt: skip
    print(format_rows(rows))
    print(f"real run {real_seconds:.0f}s, simulated in {sim_seconds:.1f}s")
    steps_priced = step_errors(steps, ProfiledCostModel(profile))
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


def _requests(
    args: argparse.Namespace, config: EngineConfig
) -> tuple[Workload, ArrivalSpec, list[float]]:
    """The workload and its arrival times, which both sides replay."""
    arrival = arrival_spec(args)
    if arrival.max_concurrency is not None or arrival.process == "closed":
        raise ValueError("bench fidelity needs open-loop arrivals (poisson, gamma or trace)")
    workload = build_workload(workload_spec(args), load_tokenizer(config.model))
    trace = [r.arrival or 0.0 for r in workload.requests] if workload.has_arrival_times else None
    return workload, arrival, arrival_offsets(arrival, len(workload.requests), config.seed, trace)


def _cost_profile(args: argparse.Namespace, engine: Any, config: EngineConfig) -> CostProfile:
    if args.cost_profile:
        return CostProfile.load(args.cost_profile)
    # Profiled here and now: the same engine settings, and the same spell of a machine
    # whose speed drifts by 10-20% over minutes.
    started = time.perf_counter()
    grid = ProfileGrid().fitting(config, engine.max_request_tokens())
    profile = profile_engine(engine, grid, config.seed)
    print(f"profiled the engine in {time.perf_counter() - started:.0f}s")
    return profile


def _run_real(
    engine: Any, workload: Workload, offsets: list[float]
) -> tuple[Side, float, list[tuple[SchedulerOutput, float]]]:
    """The real engine's side (warmed up, its prefix cache emptied), its wall time and its
    steps as timed."""
    from iterserve.bench.offline import OfflineOptions, run_engine, warm_up

    options = OfflineOptions(progress=False)
    warm_up(engine, workload, options)
    engine.reset_prefix_cache()
    steps, preemptions = engine.stats.num_steps, engine.scheduler.num_preemptions
    started = time.perf_counter()
    logged = StepLog(engine)
    result = run_engine(logged, workload, offsets, None, options)
    seconds = time.perf_counter() - started
    side = Side(
        compute_metrics(result.records),
        engine.stats.num_steps - steps,
        engine.scheduler.num_preemptions - preemptions,
    )
    return side, seconds, logged.steps


def _run_simulated(
    config: EngineConfig,
    workload: Workload,
    offsets: list[float],
    profile: CostProfile,
    engine: Any,
) -> Side:
    """The simulator's side, priced by the profile, with the real engine's KV pool size."""
    records, fleet = simulate_fleet(
        config,
        workload,
        offsets,
        "cpu-2core",  # hardware and model presets: unused, the profile and pool size decide
        "smollm2-135m",
        profile=profile,
        num_kv_blocks=engine.scheduler.kv_cache_stats().num_blocks,
    )
    replica = fleet[0]
    return Side(
        compute_metrics(records), replica.engine.stats.num_steps, replica.scheduler.num_preemptions
    )
