"""`iterserve compare`'s flags and run: the comparison itself is bench/compare.py."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from iterserve.bench import compare
from iterserve.bench.compare import POLICIES, format_table, rows_to_json, run_comparison
from iterserve.bench.workloads import build_workload
from iterserve.config import add_engine_args, engine_config_from_args


def add_subcommands(sub: argparse._SubParsersAction) -> None:
    from iterserve.cli.bench_args import add_arrival_args, add_workload_args

    p = sub.add_parser(
        "compare",
        help="run one workload through every batching policy and print one table",
        description=compare.__doc__,
    )
    add_workload_args(p, with_seed=False)
    add_arrival_args(p)
    p.add_argument(
        "--policies",
        default=",".join(POLICIES),
        help=f"comma-separated, from: {', '.join(POLICIES)}",
    )
    p.add_argument("--result-json", default="compare.json", help="where the table goes as JSON")
    p.add_argument("--disable-tqdm", action="store_true")
    add_engine_args(p)
    # The built-in comparison workload: chats and documents arriving together.
    p.set_defaults(
        func=_run,
        workload="mixed-chat-docs",
        num_requests=48,
        input_len=96,
        output_len=48,
        length_dist="uniform",
        doc_fraction=0.25,
        doc_len=1024,
        doc_output_len=16,
        request_rate=1.5,
    )


def _run(args: argparse.Namespace) -> int:
    from iterserve.bench.tokenizer import load_tokenizer
    from iterserve.cli.bench_args import arrival_spec, workload_spec

    policies = [p.strip() for p in args.policies.split(",") if p.strip()]
    unknown = [p for p in policies if p not in POLICIES]
    if unknown:
        raise ValueError(f"unknown policies {unknown}; choose from {list(POLICIES)}")
    base = engine_config_from_args(args)
    workload = build_workload(workload_spec(args), load_tokenizer(base.model))
    arrival = arrival_spec(args)
    rows = run_comparison(base, workload, arrival, policies, progress=not args.disable_tqdm)
    print(
        f"\nworkload: {workload.summary()['name']}, {len(workload.requests)} requests, "
        f"{arrival.describe()}"
    )
    print(format_table(rows))
    Path(args.result_json).write_text(json.dumps(rows_to_json(rows, workload, arrival), indent=2))
    print(f"\nwrote {args.result_json}")
    return 0
