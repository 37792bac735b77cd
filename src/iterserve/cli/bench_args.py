"""Flags and their specs shared by the benchmark commands (`iterserve bench serve |
offline | sweep`, `iterserve simulate`, `iterserve compare`): the workload, its
arrivals and the report."""

from __future__ import annotations

import argparse
import math
from typing import Any

from iterserve.bench.arrivals import ARRIVAL_PROCESSES, ArrivalSpec
from iterserve.bench.report import BenchReport, format_report
from iterserve.bench.workloads import LENGTH_DISTS, WORKLOADS, WorkloadSpec


def add_workload_args(p: argparse.ArgumentParser, with_seed: bool) -> None:
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


def add_arrival_args(p: argparse.ArgumentParser) -> None:
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


def add_report_args(p: argparse.ArgumentParser) -> None:
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


def finish(report: BenchReport, args: argparse.Namespace) -> int:
    print(format_report(report))
    if args.result_json:
        report.save(args.result_json, include_records=args.save_detailed)
        print(f"wrote {args.result_json}")
    return 0 if report.metrics.throughput.completed else 1
