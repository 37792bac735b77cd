"""`iterserve bench serve | offline | sweep` (and the simulator's `profile | fidelity`): flags -> specs -> runners -> reports.

Flag names follow `vllm bench serve` where they overlap (--num-requests, --request-rate,
--burstiness, --max-concurrency, --base-url, --ignore-eos, --num-warmups, --disable-tqdm).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from collections.abc import Callable, Sequence
from typing import Any

from iterserve.bench.metrics import parse_slos
from iterserve.bench.peer_transformers import PEERS
from iterserve.bench.report import BenchReport
from iterserve.cli.bench_args import (
    add_arrival_args,
    add_report_args,
    add_workload_args,
    arrival_spec,
    finish,
    parse_list,
    workload_spec,
)
from iterserve.config import add_engine_args, engine_config_from_args


def add_subcommands(
    sub: argparse._SubParsersAction,
    more_runners: Sequence[Callable[[argparse._SubParsersAction], None]] = (),
) -> None:
    """`bench` and its runners; `more_runners` add theirs after these (the simulator's
    calibration, which builds on this package and so cannot be imported from it)."""
    bench = sub.add_parser(
        "bench",
        help="benchmark a server or the engine: throughput and latency, reported apart",
        description="Benchmark a server or the engine: throughput and latency, reported apart.",
    )
    runners = bench.add_subparsers(dest="bench_command", required=True)

    serve = runners.add_parser(
        "serve",
        help="load an OpenAI-compatible server over HTTP (iterserve, vLLM, llama.cpp)",
        description="Stream requests to any OpenAI-compatible /v1/completions endpoint.",
    )
    add_workload_args(serve, with_seed=True)
    add_arrival_args(serve)
    _add_client_args(serve)
    add_report_args(serve)
    _add_peer_args(serve)
    serve.set_defaults(func=_run_serve)

    offline = runners.add_parser(
        "offline",
        help="the same workloads in-process, through the engine directly",
        description="Run a workload through an in-process engine on the wall clock.",
    )
    add_workload_args(offline, with_seed=False)  # --seed comes with the engine flags
    add_arrival_args(offline)
    add_report_args(offline)
    _add_peer_args(offline)
    offline.add_argument("--temperature", type=float, default=0.0)
    offline.add_argument("--ignore-eos", action=argparse.BooleanOptionalAction, default=True)
    offline.add_argument("--num-warmups", type=int, default=1)
    add_engine_args(offline)
    offline.set_defaults(func=_run_offline)

    from iterserve.cli.bench_sweep import add_sweep_parser

    add_sweep_parser(runners)
    for add in more_runners:
        add(runners)


# ---- shared flag groups ---------------------------------------------------------------


def _add_client_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("server")
    g.add_argument("--base-url", default="http://127.0.0.1:8000")
    g.add_argument("--model", default=None, help="model name (default: the server's first)")
    g.add_argument("--api-key", default=None)
    g.add_argument("--temperature", type=float, default=0.0)
    g.add_argument(
        "--ignore-eos",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="ask for exactly --output-len tokens (vLLM/iterserve extension field)",
    )
    g.add_argument("--extra-body", type=json.loads, default={}, help="JSON merged into requests")
    g.add_argument("--lane-field", default="lane", help="request field naming a batch lane")
    g.add_argument("--num-warmups", type=int, default=1)
    g.add_argument("--timeout", type=float, default=600.0)


def _add_peer_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("peer")
    g.add_argument("--peer", choices=PEERS, default=None, help="run the workload there too")
    g.add_argument("--peer-model", default=None, help="default: the model/tokenizer path")
    g.add_argument("--peer-batch-sizes", default="1,8,32", help="candidates; the best is kept")
    g.add_argument("--peer-dtype", choices=("bfloat16", "float32"), default="bfloat16")


def attach_peer(report: BenchReport, args: argparse.Namespace, workload: Any, model: str | None):
    if args.peer is None:
        return
    from iterserve.bench.peer_transformers import PeerOptions, run_transformers_peer

    options = PeerOptions(
        args.peer_model or model, parse_list(args.peer_batch_sizes, int), args.peer_dtype
    )
    print(f"peer: running the workload through {args.peer} ...", file=sys.stderr)
    report.peer = run_transformers_peer(workload, options)
    saturating = math.isinf(args.request_rate) and args.arrival in (None, "poisson", "closed")
    if not saturating or args.workload == "azure-conv":
        report.notes.append(
            "the peer ignores arrival times; the ratio compares like with like only when "
            "the main run saturates the engine (--request-rate inf or a closed loop)"
        )


# ---- runners --------------------------------------------------------------------------


def _run_serve(args: argparse.Namespace) -> int:
    from iterserve.bench.arrivals import arrival_offsets
    from iterserve.bench.client import ClientConfig, client_report, run_client
    from iterserve.bench.tokenizer import load_tokenizer
    from iterserve.bench.workloads import build_workload

    slos = parse_slos(args.slo)
    if "queue" in slos:
        raise ValueError("a client cannot see queue time: use `bench offline` for a queue SLO")
    arrival = arrival_spec(args)
    workload = build_workload(workload_spec(args), load_tokenizer(args.tokenizer))
    trace = [r.arrival or 0.0 for r in workload.requests] if workload.has_arrival_times else None
    offsets = arrival_offsets(arrival, len(workload.requests), args.seed, trace)
    client = ClientConfig(
        base_url=args.base_url,
        model=args.model,
        ignore_eos=args.ignore_eos,
        temperature=args.temperature,
        api_key=args.api_key,
        extra_body=args.extra_body,
        lane_field=args.lane_field or None,
        timeout=args.timeout,
        num_warmups=args.num_warmups,
        progress=not args.disable_tqdm,
    )
    result = run_client(client, workload, offsets, arrival.max_concurrency)
    report = client_report(result, workload, arrival, slos, args.base_url, args.label)
    attach_peer(report, args, workload, args.tokenizer)
    return finish(report, args)


def _run_offline(args: argparse.Namespace) -> int:
    from iterserve.bench.offline import OfflineOptions, benchmark_engine
    from iterserve.bench.tokenizer import load_tokenizer
    from iterserve.bench.workloads import build_workload
    from iterserve.engine.llm_engine import LLMEngine

    slos = parse_slos(args.slo)
    arrival = arrival_spec(args)
    config = engine_config_from_args(args)
    engine = LLMEngine(config)
    tokenizer = load_tokenizer(args.tokenizer) if args.tokenizer else engine.tokenizer
    workload = build_workload(workload_spec(args), tokenizer)
    options = OfflineOptions(
        ignore_eos=args.ignore_eos,
        temperature=args.temperature,
        num_warmups=args.num_warmups,
        progress=not args.disable_tqdm,
    )
    report = benchmark_engine(engine, workload, arrival, slos, options, args.label, args.seed)
    del engine  # the peer gets the memory (and the cores) to itself
    attach_peer(report, args, workload, config.model)
    return finish(report, args)
