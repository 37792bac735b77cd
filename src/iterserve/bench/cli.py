"""`iterserve bench serve | offline | sweep`: flags -> specs -> runners -> reports.

Flag names follow `vllm bench serve` where they overlap (--num-requests, --request-rate,
--burstiness, --max-concurrency, --base-url, --ignore-eos, --num-warmups, --disable-tqdm).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from typing import Any

from iterserve.bench.arrivals import ARRIVAL_PROCESSES, ArrivalSpec
from iterserve.bench.metrics import parse_slos
from iterserve.bench.peer_transformers import PEERS
from iterserve.bench.report import BenchReport, format_report
from iterserve.bench.workloads import LENGTH_DISTS, WORKLOADS, WorkloadSpec
from iterserve.config import add_engine_args, engine_config_from_args


def add_subcommands(sub: argparse._SubParsersAction) -> None:
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
    _add_workload_args(serve, with_seed=True)
    _add_arrival_args(serve)
    _add_client_args(serve)
    _add_report_args(serve)
    _add_peer_args(serve)
    serve.set_defaults(func=_run_serve)

    offline = runners.add_parser(
        "offline",
        help="the same workloads in-process, through the engine directly",
        description="Run a workload through an in-process engine on the wall clock.",
    )
    _add_workload_args(offline, with_seed=False)  # --seed comes with the engine flags
    _add_arrival_args(offline)
    _add_report_args(offline)
    _add_peer_args(offline)
    offline.add_argument("--temperature", type=float, default=0.0)
    offline.add_argument("--ignore-eos", action=argparse.BooleanOptionalAction, default=True)
    offline.add_argument("--num-warmups", type=int, default=1)
    add_engine_args(offline)
    offline.set_defaults(func=_run_offline)

    from iterserve.bench.sweep_cli import add_sweep_parser

    add_sweep_parser(runners)


# ---- shared flag groups ---------------------------------------------------------------


def _add_workload_args(p: argparse.ArgumentParser, with_seed: bool) -> None:
    g = p.add_argument_group("workload")
    g.add_argument("--workload", choices=WORKLOADS, default="synthetic")
    g.add_argument("--num-requests", type=int, default=100)
    g.add_argument("--input-len", type=int, default=128, help="prompt tokens (mean)")
    g.add_argument("--output-len", type=int, default=128, help="output tokens (mean)")
    g.add_argument("--length-dist", choices=LENGTH_DISTS, default="fixed")
    g.add_argument("--range-ratio", type=float, default=0.5, help="uniform: len * (1 +- r)")
    g.add_argument("--lognormal-sigma", type=float, default=0.5)
    g.add_argument("--max-prompt-len", type=int, default=None, help="clip prompt lengths")
    g.add_argument("--max-output-len", type=int, default=None, help="clip output lengths")
    g.add_argument("--prefix-len", type=int, default=256, help="shared-prefix: system prompt")
    g.add_argument("--num-prefixes", type=int, default=1, help="shared-prefix: distinct ones")
    g.add_argument("--doc-fraction", type=float, default=0.2, help="mixed-chat-docs: share")
    g.add_argument("--doc-len", type=int, default=1024, help="mixed-chat-docs: document tokens")
    g.add_argument("--doc-output-len", type=int, default=32)
    g.add_argument("--trace", default=None, help="azure-conv: CSV path (default: bundled)")
    g.add_argument(
        "--time-scale", type=float, default=1.0, help="trace: multiply gaps (0.1 = 10x faster)"
    )
    g.add_argument(
        "--prompt-format",
        choices=("ids", "text"),
        default="ids",
        help="send prompts as token-id lists (exact) or text that re-tokenizes exactly",
    )
    g.add_argument(
        "--tokenizer", default=None, help="HF dir or GGUF whose vocabulary builds the prompts"
    )
    if with_seed:
        g.add_argument("--seed", type=int, default=0)


def _add_arrival_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("arrivals")
    g.add_argument(
        "--arrival",
        choices=ARRIVAL_PROCESSES,
        default=None,
        help="default: the trace's clock for azure-conv, else poisson",
    )
    g.add_argument("--request-rate", type=float, default=math.inf, help="req/s; inf: all at once")
    g.add_argument("--burstiness", type=float, default=1.0, help="gamma shape; < 1 is burstier")
    g.add_argument("--max-concurrency", type=int, default=None)


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


def _add_report_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("report")
    g.add_argument(
        "--slo",
        "--goodput",
        dest="slo",
        default=None,
        help="goodput SLOs, e.g. ttft=500ms,tpot=100ms (also tbt, e2e, queue)",
    )
    g.add_argument("--result-json", default=None, help="write the report here as JSON")
    g.add_argument("--save-detailed", action="store_true", help="per-request records in JSON")
    g.add_argument("--label", default=None)
    g.add_argument("--disable-tqdm", action="store_true")


def _add_peer_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("peer")
    g.add_argument("--peer", choices=PEERS, default=None, help="run the workload there too")
    g.add_argument("--peer-model", default=None, help="default: the model/tokenizer path")
    g.add_argument("--peer-batch-sizes", default="1,8,32", help="candidates; the best is kept")
    g.add_argument("--peer-dtype", choices=("bfloat16", "float32"), default="bfloat16")


# ---- args -> specs --------------------------------------------------------------------


def workload_spec(args: argparse.Namespace) -> WorkloadSpec:
    return WorkloadSpec(
        name=args.workload,
        num_requests=args.num_requests,
        input_len=args.input_len,
        output_len=args.output_len,
        length_dist=args.length_dist,
        range_ratio=args.range_ratio,
        lognormal_sigma=args.lognormal_sigma,
        max_prompt_len=args.max_prompt_len,
        max_output_len=args.max_output_len,
        prefix_len=args.prefix_len,
        num_prefixes=args.num_prefixes,
        doc_fraction=args.doc_fraction,
        doc_len=args.doc_len,
        doc_output_len=args.doc_output_len,
        trace=args.trace,
        time_scale=args.time_scale,
        prompt_format=args.prompt_format,
        seed=args.seed,
    )


def arrival_spec(args: argparse.Namespace) -> ArrivalSpec:
    process = args.arrival or ("trace" if args.workload == "azure-conv" else "poisson")
    return ArrivalSpec(process, args.request_rate, args.burstiness, args.max_concurrency).validate()


def parse_list(text: str | None, kind: type = str) -> list[Any]:
    return [kind(v.strip()) for v in text.split(",") if v.strip()] if text else []


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


def finish(report: BenchReport, args: argparse.Namespace) -> int:
    print(format_report(report))
    if args.result_json:
        report.save(args.result_json, include_records=args.save_detailed)
        print(f"wrote {args.result_json}")
    return 0 if report.metrics.throughput.completed else 1


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
