"""What serving adds to one stream's time per token: `iterserve serve` against the same
engine offline, in alternating rounds.

Issue 8 asks that one stream's TPOT through the server be within 15% of the offline step.
This machine's speed drifts by 20-40% within minutes, so the two are measured in turns:
each round runs one prompt offline (an engine in this process, the decode step's median
wall time, as `decode_speed.py` measures it) and then `--requests` one-at-a-time streams
through a server started once for the whole run (TPOT as the benchmark client measures it,
`iterserve bench serve`'s own client). Per round it prints

  offline ms    median decode step of the offline engine
  served ms     TPOT p50 over the round's streams (client side)
  ratio         served / offline
  loop ms/tok   CPU time of the server's event-loop thread per streamed token (SSE chunks,
                socket writes): what the engine waits for between steps by design
  client ms/tok CPU time of the benchmark client per token: it shares the two cores

and the median ratio over the rounds; writes JSON. Asserts nothing.

    .venv/bin/python benchmarks/served_overhead.py [--rounds 4] [--requests 6] \
        [--server-args "--weights int8"]
"""

from __future__ import annotations

import argparse
import os
import shlex
import statistics
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from _results import write_results  # type: ignore[import-not-found]  # run from benchmarks/
from decode_speed import run_batch  # type: ignore[import-not-found]  # run from benchmarks/
from iterserve.bench.client import ClientConfig, run_client
from iterserve.bench.server_process import launch_server
from iterserve.bench.tokenizer import load_tokenizer
from iterserve.bench.workloads import WorkloadSpec, build_workload
from iterserve.config import EngineConfig
from iterserve.engine.llm import LLM


@dataclass
class Round:
    offline_step_ms: float
    served_tpot_ms: float
    ratio: float
    loop_ms_per_token: float
    client_ms_per_token: float


def thread_cpu_seconds(pid: int, tid: int) -> float:
    """utime + stime of one thread of another process (/proc, Linux)."""
    fields = Path(f"/proc/{pid}/task/{tid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--requests", type=int, default=6, help="served streams per round")
    parser.add_argument("--prompt-len", type=int, default=256)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--server-args", default="", help="extra `iterserve serve` flags")
    parser.add_argument("--json", default="bench_results/served_overhead.json")
    args = parser.parse_args()

    server_args = shlex.split(args.server_args)
    server = launch_server(EngineConfig(), extra_args=server_args)
    offline = LLM(enable_prefix_caching=False, **_engine_kwargs(server_args))
    tokenizer = load_tokenizer(None)
    client = ClientConfig(server.base_url, progress=False)
    rounds: list[Round] = []
    print(f"{'round':>5s} {'offline ms':>11s} {'served ms':>10s} {'ratio':>6s} "
          f"{'loop ms/tok':>12s} {'client ms/tok':>14s}")  # fmt: skip
    try:
        for index in range(args.rounds):
            spec = WorkloadSpec(
                num_requests=args.requests,
                input_len=args.prompt_len,
                output_len=args.output_len,
                seed=index,
            )
            workload = build_workload(spec, tokenizer)
            prompt = workload.requests[0].prompt_token_ids
            offline_ms = run_batch(offline, [prompt], args.output_len)[3]

            loop_before = thread_cpu_seconds(server.process.pid, server.process.pid)
            client_before = time.thread_time()
            result = run_client(client, workload, [0.0] * len(workload.requests), 1)
            client_cpu = time.thread_time() - client_before
            loop_cpu = thread_cpu_seconds(server.process.pid, server.process.pid) - loop_before
            tokens = sum(r.output_len for r in result.records if r.success)
            tpots = [r.tpot for r in result.records if r.success and r.tpot is not None]
            served_ms = statistics.median(tpots) * 1e3
            row = Round(
                offline_ms,
                served_ms,
                served_ms / offline_ms,
                loop_cpu / tokens * 1e3,
                client_cpu / tokens * 1e3,
            )
            rounds.append(row)
            print(f"{index:5d} {row.offline_step_ms:11.2f} {row.served_tpot_ms:10.2f} "
                  f"{row.ratio:6.2f} {row.loop_ms_per_token:12.3f} "
                  f"{row.client_ms_per_token:14.3f}", flush=True)  # fmt: skip
    finally:
        server.stop()
    median_ratio = statistics.median(r.ratio for r in rounds)
    print(f"median served/offline: {median_ratio:.2f}")
    write_results(
        args.json,
        {
            "server_args": server_args,
            "median_ratio": median_ratio,
            "rounds": [asdict(r) for r in rounds],
        },
    )


def _engine_kwargs(server_args: list[str]) -> dict[str, str]:
    """The offline engine takes the server's `--weights` (the one flag that changes the
    step's kernels); other flags are for the server alone."""
    if "--weights" in server_args:
        return {"weights": server_args[server_args.index("--weights") + 1]}
    return {}


if __name__ == "__main__":
    main()
