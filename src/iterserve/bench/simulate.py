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
from dataclasses import asdict

from iterserve.bench.arrivals import ArrivalSpec, arrival_offsets
from iterserve.bench.metrics import compute_metrics, parse_slos
from iterserve.bench.records import RequestRecord
from iterserve.bench.report import BenchReport
from iterserve.bench.workloads import Workload
from iterserve.config import EngineConfig, add_engine_args, engine_config_from_args
from iterserve.core.request import Request
from iterserve.core.scheduler import Scheduler
from iterserve.engine.engine_core import EngineCore, num_kv_blocks
from iterserve.executor.simulated import (
    HARDWARE,
    MODELS,
    RooflineCostModel,
    SimulatedExecutor,
    VirtualClock,
)
from iterserve.sampling_params import InvalidRequestError, SamplingParams

# Share of the accelerator's memory left to weights + KV cache (the rest: activations).
_MEMORY_UTILIZATION = 0.9


def kv_blocks_for(config: EngineConfig, hardware: str, model: str) -> int:
    """Blocks that fit beside the weights, unless the config names an exact count."""
    hw, shape = HARDWARE[hardware], MODELS[model]
    free = hw.memory_bytes * _MEMORY_UTILIZATION - shape.weight_bytes
    num_blocks = num_kv_blocks(config.cache, shape.kv_bytes_per_token, free)
    if num_blocks < 1:
        raise ValueError(f"{model} does not fit in {hardware}'s memory")
    return num_blocks


def simulate(
    config: EngineConfig,
    workload: Workload,
    offsets: list[float],
    hardware: str,
    model: str,
    acceptance_rate: float = 0.0,
) -> tuple[list[RequestRecord], Scheduler, SimulatedExecutor]:
    """Replay the workload on the virtual clock; one record per request. With speculation
    on (config.speculative), each draft token is accepted with `acceptance_rate`."""
    clock = VirtualClock()
    executor = SimulatedExecutor(
        RooflineCostModel(HARDWARE[hardware], MODELS[model]), clock, acceptance_rate, config.seed
    )
    engine = EngineCore.build(
        config,
        executor,
        kv_blocks_for(config, hardware, model),
        config.scheduler.max_model_len or 131072,
        clock,
    )
    records = [
        RequestRecord(f"sim-{i}", r.prompt_len, r.output_len, r.lane, offsets[i], offsets[i])
        for i, r in enumerate(workload.requests)
    ]
    by_id = {record.request_id: record for record in records}
    requests: dict[str, Request] = {}  # the ones the scheduler took, until they finish
    order = sorted(range(len(records)), key=lambda i: offsets[i], reverse=True)
    while order or engine.has_unfinished():
        while order and offsets[order[-1]] <= clock.now:
            request = _arrive(engine.scheduler, workload, records, order.pop())
            if request is not None:
                requests[request.request_id] = request
        step = engine.step(no_more_arrivals=not order)
        if not step.did_work:
            # Nothing runnable: jump to the next arrival (or let a dynamic batch's wait pass).
            wait = config.scheduler.max_wait_ms / 1000 if engine.has_unfinished() else None
            next_arrival = offsets[order[-1]] if order else None
            candidates = [t for t in (next_arrival, wait and clock.now + wait) if t]
            if not candidates:
                raise RuntimeError("the simulated scheduler is stuck with nothing to run")
            clock.advance_to(min(candidates))
            continue
        for update in step.updates:
            if update.finished:
                _record(by_id[update.request_id], requests.pop(update.request_id))
    return records, engine.scheduler, executor


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
    started = time.perf_counter()
    records, scheduler, executor = simulate(
        config, workload, offsets, args.hardware, args.sim_model, args.spec_acceptance_rate
    )
    notes = [
        f"{scheduler.kv_cache_stats().num_blocks} KV blocks, {scheduler.num_preemptions} "
        f"preemptions, accelerator busy {executor.busy_time:.1f}s of virtual time; "
        f"simulated in {time.perf_counter() - started:.1f}s of wall time"
    ]
    spec = scheduler.spec_stats
    if spec.num_drafts:
        notes.append(
            f"speculation: {spec.num_draft_tokens} draft tokens, acceptance "
            f"{spec.acceptance_rate:.2f}, mean accepted length {spec.mean_accepted_length:.2f}"
        )
    report = BenchReport(
        label=args.label or f"simulated {args.sim_model} on {args.hardware}",
        backend="simulated",
        target=f"{args.sim_model} @ {args.hardware} (roofline cost model)",
        workload=workload.summary(),
        arrivals=arrival.describe(),
        metrics=compute_metrics(records, slos=parse_slos(args.slo)),
        engine_config=asdict(config),
        notes=notes,
        records=records,
    )
    return finish(report, args)
