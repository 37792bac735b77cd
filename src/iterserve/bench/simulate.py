"""`iterserve simulate`: the real scheduler against a cost model, on a virtual clock.

The same engine loop (engine/engine_core.py), with the same `core/` scheduler and block
pool, decides every step; only the executor differs (executor/simulated.py): it prices
a step with a roofline model of a chosen accelerator and model, and never computes a
token. So a whole hour of the Azure
trace on an A100 running Llama-3-8B takes seconds here, and a change of policy shows
what it would do at a scale this machine cannot reach.
"""

from __future__ import annotations

import argparse
import time
from dataclasses import asdict, dataclass, field

from iterserve.bench.arrivals import ArrivalSpec, arrival_offsets
from iterserve.bench.metrics import compute_metrics, parse_slos
from iterserve.bench.records import RequestRecord
from iterserve.bench.report import BenchReport
from iterserve.bench.workloads import Workload
from iterserve.config import EngineConfig, add_engine_args, engine_config_from_args
from iterserve.core.request import Request
from iterserve.core.router import ROUTERS, ReplicaLoadTracker, make_router
from iterserve.core.scheduler import Scheduler
from iterserve.engine.engine_core import EngineCore, num_kv_blocks
from iterserve.executor.cost_profile import CostProfile, ProfiledCostModel, shipped_profile
from iterserve.executor.simulated import (
    HARDWARE,
    MODELS,
    CostModel,
    RooflineCostModel,
    SimulatedExecutor,
    VirtualClock,
)
from iterserve.sampling_params import InvalidRequestError, SamplingParams

# Share of the accelerator's memory left to weights + KV cache (the rest: activations).
_MEMORY_UTILIZATION = 0.9


def kv_blocks_for(config: EngineConfig, hardware: str, model: str) -> int:
    """Blocks that fit beside the weights in the device's memory, or in --kv-cache-memory
    for a preset sized as iterserve's engine sizes its pool; the config's exact count if
    it names one."""
    hw, shape = HARDWARE[hardware], MODELS[model]
    if hw.kv_cache_from_config:
        free = config.cache.kv_cache_memory * 2**30
    else:
        free = hw.memory_bytes * _MEMORY_UTILIZATION - shape.weight_bytes
    num_blocks = num_kv_blocks(config.cache, shape.kv_bytes_per_token, free)
    if num_blocks < 1:
        raise ValueError(f"{model} does not fit in {hardware}'s memory")
    return num_blocks


@dataclass
class Replica:
    """One simulated engine of a fleet: its own clock, cost model, scheduler and KV pool."""

    clock: VirtualClock
    executor: SimulatedExecutor
    engine: EngineCore
    tracker: ReplicaLoadTracker = field(default_factory=ReplicaLoadTracker)  # what routing sees

    @classmethod
    def build(
        cls,
        config: EngineConfig,
        hardware: str,
        model: str,
        acceptance_rate: float,
        seed: int,
        profile: CostProfile | None = None,
        num_kv_blocks: int | None = None,
    ) -> Replica:
        """A replica priced by `profile` if given, else by the roofline model of `hardware`
        and `model`; with `num_kv_blocks` blocks, else what fits beside the weights."""
        clock = VirtualClock()
        cost: CostModel = (
            ProfiledCostModel(profile)
            if profile is not None
            else RooflineCostModel(HARDWARE[hardware], MODELS[model])
        )
        executor = SimulatedExecutor(cost, clock, acceptance_rate, seed)
        engine = EngineCore.build(
            config,
            executor,
            num_kv_blocks or kv_blocks_for(config, hardware, model),
            config.scheduler.max_model_len or 131072,
            clock,
        )
        return cls(clock, executor, engine)

    @property
    def scheduler(self) -> Scheduler:
        return self.engine.scheduler


def simulate_fleet(
    config: EngineConfig,
    workload: Workload,
    offsets: list[float],
    hardware: str,
    model: str,
    acceptance_rate: float = 0.0,
    replicas: int = 1,
    router: str = "round-robin",
    profile: CostProfile | None = None,
    num_kv_blocks: int | None = None,
) -> tuple[list[RequestRecord], list[Replica]]:
    """Replay the workload on `replicas` engines behind a router (core/router.py).

    Discrete events in virtual time: the next thing to happen is either the next arrival
    (routed on the replicas' loads at that moment) or a step of the busy replica furthest
    behind, whose clock then moves on by the step's cost. Replicas run side by side; an
    idle one waits for its next request. One replica makes exactly the decisions of a
    single engine."""
    if replicas < 1:
        raise ValueError(f"--replicas must be at least 1, got {replicas}")
    fleet = [
        Replica.build(
            config, hardware, model, acceptance_rate, config.seed + i, profile, num_kv_blocks
        )
        for i in range(replicas)
    ]
    routing = make_router(router, config.cache.block_size, config.seed)
    records = [
        RequestRecord(f"sim-{i}", r.prompt_len, r.output_len, r.lane, offsets[i], offsets[i])
        for i, r in enumerate(workload.requests)
    ]
    by_id = {record.request_id: record for record in records}
    requests: dict[str, Request] = {}  # the ones a scheduler took, until they finish
    order = sorted(range(len(records)), key=lambda i: offsets[i], reverse=True)
    while True:
        busy = [r for r in fleet if r.engine.has_unfinished()]
        if not order and not busy:
            break
        laggard = min(busy, key=lambda r: r.clock.now) if busy else None
        if order and (laggard is None or offsets[order[-1]] <= laggard.clock.now):
            i = order.pop()
            for replica in fleet:
                if not replica.engine.has_unfinished():
                    replica.clock.advance_to(offsets[i])
            prompt = workload.requests[i].prompt_token_ids
            target = fleet[routing.route(prompt, [r.tracker.load() for r in fleet])]
            request = _arrive(target.scheduler, workload, records, i)
            if request is not None:
                requests[request.request_id] = request
                target.tracker.take(
                    request.request_id, len(prompt), request.sampling_params.max_tokens
                )
            continue
        assert laggard is not None
        step = laggard.engine.step(no_more_arrivals=not order)
        if not step.did_work:
            # Nothing runnable: jump to the next arrival (or let a dynamic batch's wait pass).
            wait = config.scheduler.max_wait_ms / 1000
            next_arrival = offsets[order[-1]] if order else None
            candidates = [t for t in (next_arrival, wait and laggard.clock.now + wait) if t]
            if not candidates:
                raise RuntimeError("the simulated scheduler is stuck with nothing to run")
            laggard.clock.advance_to(min(candidates))
            continue
        for update in step.updates:
            laggard.tracker.progress(update.request_id, len(update.new_token_ids), update.finished)
            if update.finished:
                _record(by_id[update.request_id], requests.pop(update.request_id))
    return records, fleet


def _arrive(
    scheduler: Scheduler, workload: Workload, records: list[RequestRecord], i: int
) -> Request | None:
    wanted = workload.requests[i]
    params = SamplingParams(max_tokens=wanted.output_len, ignore_eos=True)
    request = Request(
        records[i].request_id,
        wanted.prompt_token_ids,
        params,
        records[i].arrival_time,
        lane=wanted.lane,
    )
    try:
        scheduler.add_request(request)
    except InvalidRequestError as err:
        records[i].error = str(err)
        return None
    return request


def _record(record: RequestRecord, request: Request) -> None:
    t = request.timings
    record.first_scheduled_time = t.first_scheduled
    record.first_token_time = t.first_token
    record.token_times = list(t.token_times)
    record.finish_time = t.finished
    record.output_len = request.num_output_tokens
    record.num_cached_tokens = request.num_cached_tokens
    record.success = True


# ---- CLI -------------------------------------------------------------------------------


def add_subcommands(sub: argparse._SubParsersAction) -> None:
    from iterserve.bench.args import add_arrival_args, add_report_args, add_workload_args

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
        help="with --replicas: how a request picks its engine (core/router.py)",
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
    add_workload_args(p, with_seed=False)
    add_arrival_args(p)
    add_report_args(p)
    add_engine_args(p)  # scheduler and cache settings; --model names the tokenizer
    p.set_defaults(func=_run)


def _run(args: argparse.Namespace) -> int:
    from iterserve.bench.args import arrival_spec, finish, workload_spec
    from iterserve.bench.tokenizer import load_tokenizer
    from iterserve.bench.workloads import build_workload

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
    records, fleet = simulate_fleet(
        config,
        workload,
        offsets,
        args.hardware,
        args.sim_model,
        args.spec_acceptance_rate,
        args.replicas,
        args.router,
        profile,
    )
    wall = time.perf_counter() - started
    steps = sum(r.engine.stats.num_steps for r in fleet)
    notes = [
        f"{len(fleet)} x {args.sim_model} on {args.hardware}"
        + (f" behind the {args.router} router" if len(fleet) > 1 else "")
        + f"; simulated in {wall:.1f}s of wall time ({steps} steps, "
        f"{1e6 * wall / max(1, steps):.0f} us a step)"
    ]
    notes.append(_cost_note(profile, args.cost_profile))
    notes += [_replica_note(i, replica, len(fleet) > 1) for i, replica in enumerate(fleet)]
    report = BenchReport(
        label=args.label or f"simulated {args.sim_model} on {args.hardware}",
        backend="simulated",
        target=f"{len(fleet)} x {args.sim_model} @ {args.hardware} "
        f"({'roofline' if profile is None else 'profiled'} cost model)",
        workload=workload.summary(),
        arrivals=arrival.describe(),
        metrics=compute_metrics(records, slos=parse_slos(args.slo)),
        engine_config=asdict(config),
        notes=notes,
        records=records,
    )
    return finish(report, args)


def _cost_note(profile: CostProfile | None, path: str | None) -> str:
    if profile is None:
        return (
            "cost model: roofline (no profile for this hardware and model: steps are priced "
            "by peak FLOP/s and bandwidth, not measured)"
        )
    about = profile.about
    where = path or "the shipped profile"
    if not profile.measured:
        return f"cost model: {where}, NOT measured"
    return (
        f"cost model: {where}, measured on {about.get('cpu', '?')} with "
        f"{about.get('threads', '?')} threads, {about.get('weights', '?')} weights, "
        f"{about.get('date', '?')}"
    )


def _replica_note(index: int, replica: Replica, named: bool) -> str:
    """One replica's share and state: the fleet figures are the report's own."""
    scheduler, stats = replica.scheduler, replica.engine.stats
    kv = scheduler.kv_cache_stats()
    hit_rate = kv.prefix_hits / kv.prefix_queries if kv.prefix_queries else 0.0
    note = (
        f"{f'replica {index}: ' if named else ''}{replica.tracker.num_routed} requests, "
        f"{stats.generated_tokens} output tokens, prefix-cache hit rate {hit_rate:.2f}, "
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
