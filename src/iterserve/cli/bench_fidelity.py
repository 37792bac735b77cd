"""`iterserve bench fidelity`'s flags and run: the comparison itself is sim/fidelity.py."""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from iterserve.bench.metrics import compute_metrics
from iterserve.sim import fidelity
from iterserve.sim.cost_profile import ProfiledCostModel
from iterserve.sim.fidelity import Side, StepLog, compare, format_rows, step_errors


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
    from iterserve.bench.arrivals import arrival_offsets
    from iterserve.bench.offline import OfflineOptions, run_engine, warm_up
    from iterserve.bench.tokenizer import load_tokenizer
    from iterserve.bench.workloads import build_workload
    from iterserve.cli.bench_args import arrival_spec, workload_spec
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
