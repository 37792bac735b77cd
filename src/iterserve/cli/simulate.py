"""`iterserve simulate`: the real scheduler against a cost model, on a virtual clock.

The same engine loop (engine/engine_core.py), with the same `core/` scheduler and block
pool, decides every step; only the executor differs (sim/executor.py): it prices
a step with a measured profile or a roofline model of a chosen accelerator and model,
and never computes a token. So a whole hour of the Azure trace on an A100 running
Llama-3-8B takes seconds here, a fleet of replicas behind a router (sim/fleet.py) a few
minutes for a million requests, and a change of policy shows what it would do at a scale
this machine cannot reach.
"""

from __future__ import annotations

import argparse
import time
from dataclasses import asdict

from iterserve.bench.arrivals import ArrivalSpec, arrival_offsets
from iterserve.bench.metrics import BenchMetrics, compute_metrics, parse_slos
from iterserve.bench.records import RequestRecord
from iterserve.bench.report import BenchReport
from iterserve.config import add_engine_args, engine_config_from_args
from iterserve.replicas.router import ROUTERS
from iterserve.sim.cost_profile import CostProfile, shipped_profile
from iterserve.sim.executor import HARDWARE, MODELS
from iterserve.sim.fleet import Replica, simulate_fleet
from iterserve.sim.outages import ReplicaOutage

# ---- CLI -------------------------------------------------------------------------------


def add_subcommands(sub: argparse._SubParsersAction) -> None:
    from iterserve.cli.bench_args import add_arrival_args, add_report_args, add_workload_args

    p = sub.add_parser(
        "simulate",
        help="replay a workload through the real scheduler on a cost model (no model runs)",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--hardware", choices=sorted(HARDWARE), default="a100-80g")
    p.add_argument("--sim-model", choices=sorted(MODELS), default="llama3-8b")
    p.add_argument(
        "--replicas",
        type=int,
        default=1,
        help="engines behind a router, each with its own KV cache (a fleet of accelerators)",
    )
    p.add_argument(
        "--router",
        choices=ROUTERS,
        default="least-tokens",
        help="with --replicas: how a request picks its engine (replicas/router.py)",
    )
    p.add_argument(
        "--replica-failures",
        nargs="+",
        type=_replica_failure,
        default=[],
        metavar="t=S,replica=I,down=S",
        help="with --replicas: replica I fails S seconds in (its requests that had made a "
        "token are lost, the rest go to other replicas) and serves again, with an empty cache, "
        "`down` seconds later (sim/outages.py); the report says what each failure cost and "
        "compares p99 TTFT and E2E with a second replay without failures",
    )
    p.add_argument(
        "--cost-profile",
        default=None,
        help="price steps by this profile (`iterserve bench profile`); default: the one "
        "shipped for --hardware and --sim-model if any, else the roofline model",
    )
    p.add_argument(
        "--spec-acceptance-rate",
        type=float,
        default=0.7,
        help="with --speculative-method: chance that each draft token is accepted",
    )
    p.add_argument(
        "--step-by-step",
        action="store_true",
        help="update every decoding request every step, as the engine does, instead of "
        "advancing steady decodes together (the same results, slower)",
    )
    add_workload_args(p, with_seed=False)
    add_arrival_args(p)
    add_report_args(p)
    add_engine_args(p)  # scheduler and cache settings; --model names the tokenizer
    # Block names need no collision resistance where no one crafts prompts, and sha256 of
    # every block was a fifth of a large simulation's time (the decisions are the same).
    p.set_defaults(func=_run, prefix_caching_hash_algo="builtin")


def _run(args: argparse.Namespace) -> int:
    from iterserve.bench.tokenizer import load_tokenizer
    from iterserve.bench.workloads import build_workload
    from iterserve.cli.bench_args import arrival_spec, finish, workload_spec

    config = engine_config_from_args(args)
    arrival: ArrivalSpec = arrival_spec(args)
    workload = build_workload(workload_spec(args), load_tokenizer(config.model))
    trace = [r.arrival or 0.0 for r in workload.requests] if workload.has_arrival_times else None
    offsets = arrival_offsets(arrival, len(workload.requests), config.seed, trace)
    if args.cost_profile:
        profile = CostProfile.load(args.cost_profile)
    else:
        profile = shipped_profile(args.hardware, args.sim_model)
    started = time.perf_counter()

    def replay(outages: list[ReplicaOutage]) -> tuple[list[RequestRecord], list[Replica]]:
        return simulate_fleet(
            config,
            workload,
            offsets,
            args.hardware,
            args.sim_model,
            args.spec_acceptance_rate,
            args.replicas,
            args.router,
            profile,
            step_by_step=args.step_by_step,
            outages=outages,
        )

    records, fleet = replay(args.replica_failures)
    wall = time.perf_counter() - started
    steps = sum(r.engine.stats.num_steps for r in fleet)
    notes = [
        f"{len(fleet)} x {args.sim_model} on {args.hardware}"
        + (f" behind the {args.router} router" if len(fleet) > 1 else "")
        + f"; simulated in {wall:.1f}s of wall time ({steps} steps, "
        f"{1e6 * wall / max(1, steps):.0f} us a step)"
    ]
    notes.append(
        _cost_note(
            profile, args.cost_profile, HARDWARE[args.hardware].isa, config.cache.kv_cache_dtype
        )
    )
    notes += [_replica_note(i, replica, len(fleet) > 1) for i, replica in enumerate(fleet)]
    metrics = compute_metrics(records, slos=parse_slos(args.slo))
    if args.replica_failures:
        without, _ = replay([])
        notes += _outage_notes(fleet, metrics, compute_metrics(without))
    report = BenchReport(
        label=args.label or f"simulated {args.sim_model} on {args.hardware}",
        backend="simulated",
        target=f"{len(fleet)} x {args.sim_model} @ {args.hardware} "
        f"({'roofline' if profile is None else 'profiled'} cost model)",
        workload=workload.summary(),
        arrivals=arrival.describe(),
        metrics=metrics,
        engine_config=asdict(config),
        notes=notes,
        records=records,
    )
    return finish(report, args)


def _replica_failure(text: str) -> ReplicaOutage:
    try:
        return ReplicaOutage.parse(text)
    except ValueError as error:
        raise argparse.ArgumentTypeError(str(error)) from error


def _outage_notes(fleet: list[Replica], metrics: BenchMetrics, without: BenchMetrics) -> list[str]:
    """What each failure cost, and the fleet's tail latency with and without them (of the
    requests that finished: a lost one has no latency)."""
    reports = sorted(
        (report for replica in fleet for report in replica.outages),
        key=lambda report: report.outage.at,
    )
    notes = [f"failure: {report.describe()}" for report in reports]

    def p99(block: BenchMetrics, name: str) -> str:
        value = getattr(block.latency, name)
        return "-" if value is None else f"{value.p99:.0f}"

    notes.append(
        f"with the failures / without (a second replay): p99 TTFT {p99(metrics, 'ttft')} / "
        f"{p99(without, 'ttft')} ms, p99 E2E {p99(metrics, 'e2el')} / {p99(without, 'e2el')} ms, "
        f"failed {metrics.throughput.failed} / {without.throughput.failed}"
    )
    return notes


def _cost_note(
    profile: CostProfile | None, path: str | None, isa: str | None, kv_cache_dtype: str = "auto"
) -> str:
    """Where the step prices come from; `isa`: the kernels' ISA variant the hardware preset
    describes (a profile measured with another one is flagged), and a profile priced for
    an int8 KV pool (profiles are measured over a bf16 one) is flagged too."""
    if profile is None:
        return (
            "cost model: roofline (no profile for this hardware and model: steps are priced "
            "by peak FLOP/s and bandwidth, not measured)"
        )
    about = profile.about
    where = path or "the shipped profile"
    if not profile.measured:
        return f"cost model: {where}, NOT measured"
    measured_isa = about.get("isa", "?")
    note = (
        f"cost model: {where}, measured on {about.get('cpu', '?')} ({measured_isa} kernels) "
        f"with {about.get('threads', '?')} threads, {about.get('weights', '?')} weights, "
        f"{about.get('date', '?')}"
    )
    if isa is not None and measured_isa != isa:
        note += f"; NOTE: measured with {measured_isa} kernels, the preset describes {isa}"
    if kv_cache_dtype == "int8":
        note += (
            "; NOTE: measured over a bf16 KV pool: the int8 pool's size is simulated, its "
            "steps are priced as bf16 ones"
        )
    return note


def _replica_note(index: int, replica: Replica, named: bool) -> str:
    """One replica's share and state: the fleet figures are the report's own."""
    scheduler, stats = replica.scheduler, replica.engine.stats
    kv = scheduler.kv_cache_stats()
    since = ""
    if replica.outages:  # its figures are the fresh engine's, since its last return
        last = replica.outages[-1]
        back = (last.landed or last.outage.at) + last.outage.down
        since = f" (down {len(replica.outages)}x; figures since its return at {back:.1f}s)"
    note = (
        f"{f'replica {index}{since}: ' if named else ''}{replica.tracker.num_routed} requests, "
        f"{stats.generated_tokens} output tokens, prefix-cache hit rate {kv.prefix_hit_rate:.2f}, "
        f"{kv.num_blocks} KV blocks, {scheduler.num_preemptions} preemptions, accelerator "
        f"busy {replica.executor.busy_time:.1f}s of {replica.clock.now:.1f}s virtual"
    )
    spec = scheduler.spec_stats
    if spec.num_drafts:
        note += (
            f"; speculation: {spec.num_draft_tokens} draft tokens, acceptance "
            f"{spec.acceptance_rate:.2f}, mean accepted length {spec.mean_accepted_length:.2f}"
        )
    return note
