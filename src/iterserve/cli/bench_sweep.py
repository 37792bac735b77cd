"""`iterserve bench sweep`: the flags, and the two backends a sweep point can run on.

  offline (default)  an in-process engine per configuration, reused across its load points
  serve              an `iterserve serve` child process per configuration, loaded over HTTP;
                     or, with --base-url, one server that is already running (load axes only)

The x axis is --request-rates or --concurrencies (else --max-num-seqs); every other list
(--batching continuous,static, --prefix-caching on,off, --max-num-seqs 8,32, ...) makes
one curve per value.
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import sys
from pathlib import Path
from typing import Any

from iterserve.bench.arrivals import ArrivalSpec, arrival_offsets
from iterserve.bench.metrics import parse_slos
from iterserve.bench.report import BenchReport
from iterserve.bench.sweep import CONFIG_AXES, SweepPoint, format_table, run_sweep, variants_from
from iterserve.bench.workloads import Workload
from iterserve.cli.bench_args import (
    add_arrival_args,
    add_workload_args,
    arrival_spec,
    parse_list,
    workload_spec,
)
from iterserve.config import EngineConfig, add_engine_args, engine_config_from_args


def add_sweep_parser(runners: argparse._SubParsersAction) -> None:
    # "resolve": the sweep's list-valued --batching / --max-num-seqs / --step-policy replace
    # the engine's single-valued flags of the same names.
    p = runners.add_parser(
        "sweep",
        conflict_handler="resolve",
        help="throughput-latency curves: a full run per load level, a curve per configuration",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_workload_args(p, with_seed=False)
    add_arrival_args(p)
    add_engine_args(p)
    g = p.add_argument_group("sweep")
    g.add_argument("--request-rates", default=None, help="x axis: req/s list, e.g. 1,2,4,inf")
    g.add_argument("--concurrencies", default=None, help="x axis: closed-loop concurrency list")
    for name in CONFIG_AXES:
        g.add_argument(
            "--" + name.replace("_", "-"),
            dest=f"sweep_{name}",
            default=None,
            help="comma list: one curve per value"
            + (" (or the x axis)" * (name == "max_num_seqs")),
        )
    g.add_argument("--backend", choices=("offline", "serve"), default="offline")
    g.add_argument("--base-url", default=None, help="serve backend: a running server to load")
    g.add_argument("--output-dir", default="bench-sweep", help="sweep.txt, .json and .png here")
    g.add_argument("--slo", "--goodput", dest="slo", default=None)
    g.add_argument("--temperature", type=float, default=0.0)
    g.add_argument("--ignore-eos", action=argparse.BooleanOptionalAction, default=True)
    g.add_argument("--num-warmups", type=int, default=1)
    g.add_argument("--disable-tqdm", action="store_true")
    p.set_defaults(func=run_sweep_command)


class OfflineBackend:
    """One in-process engine at a time, rebuilt only when the configuration changes."""

    def __init__(self, workload: Workload, slos: dict[str, float], args: argparse.Namespace):
        from iterserve.bench.offline import OfflineOptions

        self.workload, self.slos, self.seed = workload, slos, args.seed
        self.options = OfflineOptions(
            args.ignore_eos, args.temperature, args.num_warmups, not args.disable_tqdm
        )
        self._engine: Any = None
        self._key = ""

    def __call__(self, config: EngineConfig, arrival: ArrivalSpec, label: str) -> BenchReport:
        from iterserve.bench.offline import benchmark_engine
        from iterserve.engine.llm_engine import LLMEngine

        key = json.dumps(dataclasses.asdict(config), sort_keys=True, default=str)
        if key != self._key:
            self._engine = None
            gc.collect()  # the old engine's KV cache goes before the new one is allocated
            self._engine, self._key = LLMEngine(config), key
        return benchmark_engine(
            self._engine, self.workload, arrival, self.slos, self.options, label, self.seed
        )

    def close(self) -> None:
        self._engine = None


class ServeBackend:
    """Loads a server over HTTP: a launched one per configuration, or the one at --base-url."""

    def __init__(self, workload: Workload, slos: dict[str, float], args: argparse.Namespace):
        from iterserve.bench.client import ClientConfig

        self.workload, self.slos, self.seed = workload, slos, args.seed
        self.base_url: str | None = args.base_url
        self.client = ClientConfig(
            base_url=args.base_url or "",
            ignore_eos=args.ignore_eos,
            temperature=args.temperature,
            num_warmups=args.num_warmups,
            progress=not args.disable_tqdm,
        )
        self._server: Any = None
        self._key = ""

    def __call__(self, config: EngineConfig, arrival: ArrivalSpec, label: str) -> BenchReport:
        from iterserve.bench.client import client_report, reset_prefix_cache, run_client
        from iterserve.bench.server_process import launch_server

        client = dataclasses.replace(self.client)
        notes = []
        if self.base_url:
            if not reset_prefix_cache(client):
                notes.append("the server has no /reset_prefix_cache: points may share a warm cache")
        else:
            key = json.dumps(dataclasses.asdict(config), sort_keys=True, default=str)
            if key != self._key:
                self.close()
                print(f"sweep: starting a server for {label!r} ...", file=sys.stderr)
                self._server, self._key = launch_server(config), key
            client.base_url = self._server.base_url
        static = config.scheduler.batching == "static"
        if static:
            _check_static(config.scheduler.batch_size, len(self.workload.requests), arrival)
            client.num_warmups = max(client.num_warmups, config.scheduler.batch_size)
        trace = (
            [r.arrival or 0.0 for r in self.workload.requests]
            if self.workload.has_arrival_times
            else None
        )
        offsets = arrival_offsets(arrival, len(self.workload.requests), self.seed, trace)
        result = run_client(client, self.workload, offsets, arrival.max_concurrency)
        result.notes += notes
        return client_report(result, self.workload, arrival, self.slos, client.base_url, label)

    def close(self) -> None:
        if self._server is not None:
            self._server.stop()
            self._server, self._key = None, ""


def _check_static(batch_size: int, num_requests: int, arrival: ArrivalSpec) -> None:
    """A static-batching server starts only full batches (it cannot know no more will come)."""
    if num_requests % batch_size:
        raise ValueError(
            f"static batching behind a server needs --num-requests a multiple of --batch-size "
            f"({batch_size}), or the last batch never starts"
        )
    if arrival.max_concurrency is not None and arrival.max_concurrency < batch_size:
        raise ValueError("static batching needs --max-concurrency >= --batch-size")


def _axis(args: argparse.Namespace) -> tuple[str, list[float], dict[str, list[str]]]:
    """(x axis, its values, the lists that make curves)."""
    lists = {name: parse_list(getattr(args, f"sweep_{name}")) for name in CONFIG_AXES}
    given = [(n, v) for n, v in (("request_rate", args.request_rates), ("max_concurrency", args.concurrencies)) if v]  # fmt: skip
    if len(given) > 1:
        raise ValueError("sweep one x axis: --request-rates or --concurrencies, not both")
    if given:
        axis, text = given[0]
    elif lists["max_num_seqs"]:
        axis, text = "max_num_seqs", ",".join(lists.pop("max_num_seqs"))
    else:
        raise ValueError("give the x axis: --request-rates, --concurrencies or --max-num-seqs")
    return axis, parse_list(text, float), lists


def run_sweep_command(args: argparse.Namespace) -> int:
    from iterserve.bench.plot import plot_sweep
    from iterserve.bench.tokenizer import load_tokenizer
    from iterserve.bench.workloads import build_workload

    axis, values, lists = _axis(args)
    variants = variants_from(lists)
    base_config = engine_config_from_args(args)
    if args.base_url and (len(variants) > 1 or axis == "max_num_seqs" or lists_nonempty(lists)):
        raise ValueError("--base-url loads one running server: sweep only its load, no settings")
    slos = parse_slos(args.slo)
    base_arrival = arrival_spec(args)
    tokenizer = load_tokenizer(args.tokenizer or base_config.model)
    workload = build_workload(workload_spec(args), tokenizer)
    backend_cls = ServeBackend if args.backend == "serve" or args.base_url else OfflineBackend
    backend = backend_cls(workload, slos, args)
    out_dir = Path(args.output_dir)
    out_dir.mkdir(parents=True, exist_ok=True)

    def progress(point: SweepPoint) -> None:
        t = point.report.metrics.throughput
        print(
            f"sweep: {point.label} {axis}={point.value:g}: {t.output_throughput:.1f} out tok/s, "
            f"{t.completed}/{t.completed + t.failed} ok",
            file=sys.stderr,
        )

    try:
        result = run_sweep(base_config, variants, axis, values, base_arrival, backend, progress)
    finally:
        backend.close()
    table = format_table(result)
    (out_dir / "sweep.txt").write_text(table + "\n")
    result.save(out_dir / "sweep.json")
    png = plot_sweep(result, out_dir / "sweep.png", f"{workload.name}: output tok/s vs p99 latency")
    print(table)
    print(f"wrote {out_dir / 'sweep.txt'}, {out_dir / 'sweep.json'}, {png}")
    return 0 if all(p.report.metrics.throughput.completed for p in result.points) else 1


def lists_nonempty(lists: dict[str, list[str]]) -> bool:
    return any(lists.values())
