"""Asynchronous scheduling on and off, in alternating rounds of the same run: offline decode
tok/s at a few batch sizes, and through `iterserve serve` one stream's TPOT and many
streams' output tok/s.

Per round and setting it prints, offline: decode tok/s, the median decode step, and the
share of a decode step's wall time outside the network's forward (scheduling, sampling,
update, detokenizing: with overlap, only what the forward still waits for); served: TPOT
p50 of one-at-a-time streams and output tok/s of `--streams` concurrent ones (the client
is iterserve's own, `iterserve bench serve`'s). Then the on/off ratio of each figure's
median over the rounds. Prints the CPU's ISA; writes JSON. Asserts nothing.

Each offline measurement runs in a process of its own: two engines in one process, one
stepping on the main thread and one on a step thread, would make OpenMP slow both down
(engine/step_pipeline.py says why), which is not what either setting costs.

    .venv/bin/python benchmarks/async_scheduling.py [--rounds 3] [--batches 1,16,64]
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
from dataclasses import asdict, dataclass

from _results import write_results  # type: ignore[import-not-found]  # run from benchmarks/
from decode_speed import run_batch  # type: ignore[import-not-found]  # run from benchmarks/
from iterserve.bench.client import ClientConfig, run_client
from iterserve.bench.machine import cpu_line
from iterserve.bench.metrics import compute_metrics
from iterserve.bench.server_process import ServerProcess, launch_server
from iterserve.bench.tokenizer import load_tokenizer, ordinary_token_ids
from iterserve.bench.workloads import WorkloadSpec, build_workload
from iterserve.config import EngineConfig
from iterserve.engine.llm import LLM

SETTINGS = {"off": False, "on": True}


@dataclass
class Figure:
    round: int
    setting: str
    what: str  # "decode b<N>", "served 1 stream", "served <N> streams"
    value: float  # tok/s, or ms for TPOT
    unit: str
    outside_forward: float | None = None


def offline(llm: LLM, batch: int, prompt_len: int, output_len: int, index: int) -> Figure:
    tokens = ordinary_token_ids(llm.engine.tokenizer)
    prompts = [
        [tokens[(index * 7919 + b * 131 + i) % len(tokens)] for i in range(prompt_len)]
        for b in range(batch)
    ]
    _, decode_tok_s, _, _, outside = run_batch(llm, prompts, output_len)
    return Figure(index, "", f"decode b{batch}", decode_tok_s, "tok/s", outside)


def offline_child(
    setting: str, batches: list[int], prompt_len: int, output_len: int, index: int
) -> None:
    """In a child process: one engine, every batch size; the figures as JSON on stdout."""
    llm = LLM(enable_prefix_caching=False, async_scheduling=SETTINGS[setting])
    figures = [offline(llm, b, prompt_len, output_len, index) for b in batches]
    llm.close()
    print(json.dumps([asdict(f) for f in figures]))


def offline_in_child(
    setting: str, batches: list[int], prompt_len: int, output_len: int, index: int
) -> list[Figure]:
    args = [setting, ",".join(map(str, batches)), str(prompt_len), str(output_len), str(index)]
    result = subprocess.run(
        [sys.executable, __file__, "--child", *args], capture_output=True, text=True, check=True
    )
    figures = [Figure(**f) for f in json.loads(result.stdout.strip().splitlines()[-1])]
    for figure in figures:
        figure.setting = setting
    return figures


def served(
    server: ServerProcess, streams: int, requests: int, prompt_len: int, output_len: int, seed: int
) -> tuple[float, float]:
    """TPOT p50 (ms) when `streams` is 1, else output tok/s."""
    spec = WorkloadSpec(
        num_requests=requests, input_len=prompt_len, output_len=output_len, seed=seed
    )
    workload = build_workload(spec, load_tokenizer(None))
    client = ClientConfig(server.base_url, progress=False)
    result = run_client(client, workload, [0.0] * requests, streams)
    ok = [r for r in result.records if r.success]
    tpot = statistics.median(r.tpot for r in ok if r.tpot is not None) * 1e3
    metrics = compute_metrics(result.records)
    return tpot, metrics.throughput.output_throughput


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--batches", default="1,16,64")
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--streams", type=int, default=16)
    parser.add_argument("--served-prompt-len", type=int, default=256)
    parser.add_argument("--served-output-len", type=int, default=128)
    parser.add_argument("--no-served", action="store_true", help="offline figures only")
    parser.add_argument("--json", default="bench_results/async_scheduling.json")
    args = parser.parse_args()
    batches = [int(b) for b in args.batches.split(",")]
    print(cpu_line(), flush=True)

    servers: dict[str, ServerProcess] = {}
    if not args.no_served:
        for name, on in SETTINGS.items():
            flag = "--async-scheduling" if on else "--no-async-scheduling"
            servers[name] = launch_server(EngineConfig(), extra_args=[flag])
    figures: list[Figure] = []
    try:
        for index in range(args.rounds):
            # Alternate which setting goes first, so a drift in the machine's speed
            # within a round does not favour one.
            order = list(SETTINGS) if index % 2 == 0 else list(reversed(SETTINGS))
            for name in order:
                lens = (args.prompt_len, args.output_len)
                for figure in offline_in_child(name, batches, *lens, index):
                    figures.append(figure)
                    print(f"round {index} {name:3s} {figure.what:>18s} "
                          f"{figure.value:9.1f} tok/s  outside forward "
                          f"{figure.outside_forward:5.1%}", flush=True)  # fmt: skip
                if name in servers:
                    lens = (args.served_prompt_len, args.served_output_len)
                    tpot, _ = served(servers[name], 1, 4, *lens, index)
                    _, tok_s = served(servers[name], args.streams, 2 * args.streams, *lens, index)
                    figures += [
                        Figure(index, name, "served 1 stream TPOT", tpot, "ms"),
                        Figure(index, name, f"served {args.streams} streams", tok_s, "tok/s"),
                    ]
                    print(f"round {index} {name:3s} served: 1 stream TPOT {tpot:6.2f} ms, "
                          f"{args.streams} streams {tok_s:7.1f} tok/s", flush=True)  # fmt: skip
    finally:
        for server in servers.values():
            server.stop()
    summary = {}
    for what in dict.fromkeys(f.what for f in figures):
        medians = {
            name: statistics.median(
                f.value for f in figures if f.what == what and f.setting == name
            )
            for name in SETTINGS
        }
        summary[what] = {**medians, "on/off": medians["on"] / medians["off"]}
        print(f"{what:>22s}: off {medians['off']:8.2f}  on {medians['on']:8.2f}  "
              f"on/off {medians['on'] / medians['off']:.3f}")  # fmt: skip
    write_results(
        args.json,
        {"cpu": cpu_line(), "summary": summary, "figures": [asdict(f) for f in figures]},
    )


if __name__ == "__main__":
    if sys.argv[1:2] == ["--child"]:
        setting, batches, prompt_len, output_len, index = sys.argv[2:7]
        sizes = [int(b) for b in batches.split(",")]
        offline_child(setting, sizes, int(prompt_len), int(output_len), int(index))
    else:
        main()
