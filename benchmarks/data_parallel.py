"""Data parallelism on this machine: two replicas of one thread each against one engine of
two threads, and what the Ray front end adds to a request, in alternating rounds.

Three servers stay up for the whole run (the same model and engine flags):

  dp2     `iterserve serve --data-parallel-size 2 --num-threads 1`: two replicas on Ray
  single  `iterserve serve --num-threads 2`: one engine in the server's process
  ray1    `iterserve serve --data-parallel-size 1 --ray-address local --num-threads 2`:
          the single engine, but as a Ray actor behind the data-parallel front end

Each round, `iterserve bench serve`'s client (bench/client.py) drives dp2 and then single
with the same load (`--requests` prompts, `--concurrency` at a time), and then sends
`--overhead-requests` streams one at a time to single and to ray1: the front end's hop is
ray1's TTFT and TPOT less single's, per request and per token. This machine's speed drifts
within minutes, hence the turns; the idle servers cost little meanwhile (the front end
reads each replica's gauges twice a second). Prints every round and the medians over
rounds (output tok/s, TTFT and TPOT p50/p99); writes JSON. Asserts nothing.

    .venv/bin/python benchmarks/data_parallel.py [--rounds 3] [--requests 32] \
        [--concurrency 16] [--server-args "--weights int8"]
"""

from __future__ import annotations

import argparse
import shlex
import statistics
from dataclasses import asdict, dataclass

from _results import write_results  # type: ignore[import-not-found]  # run from benchmarks/
from iterserve.bench.client import ClientConfig, reset_prefix_cache, run_client
from iterserve.bench.metrics import compute_metrics
from iterserve.bench.server_process import ServerProcess, launch_server
from iterserve.bench.tokenizer import load_tokenizer
from iterserve.bench.workloads import WorkloadSpec, build_workload
from iterserve.config import EngineConfig

SERVERS = {
    "dp2": ["--data-parallel-size", "2", "--num-threads", "1"],
    "single": ["--num-threads", "2"],
    "ray1": ["--data-parallel-size", "1", "--ray-address", "local", "--num-threads", "2"],
}


@dataclass
class Run:
    round: int
    server: str
    phase: str  # "load" (concurrent) or "one-at-a-time"
    output_tok_s: float
    ttft_p50_ms: float
    ttft_p99_ms: float
    tpot_p50_ms: float
    tpot_p99_ms: float
    failed: int


def drive(
    server: ServerProcess, spec: WorkloadSpec, tokenizer: object, concurrency: int
) -> tuple[float, float, float, float, float, int]:
    reset_prefix_cache(ClientConfig(server.base_url))  # every run starts cold
    workload = build_workload(spec, tokenizer)
    client = ClientConfig(server.base_url, progress=False)
    result = run_client(client, workload, [0.0] * len(workload.requests), concurrency)
    metrics = compute_metrics(result.records)
    ttft, tpot = metrics.latency.ttft, metrics.latency.tpot
    nan = float("nan")
    return (
        metrics.throughput.output_throughput,
        ttft.median if ttft else nan,
        ttft.p99 if ttft else nan,
        tpot.median if tpot else nan,
        tpot.p99 if tpot else nan,
        metrics.throughput.failed,
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--requests", type=int, default=32, help="requests of a load run")
    parser.add_argument("--concurrency", type=int, default=16, help="streams at a time")
    parser.add_argument("--overhead-requests", type=int, default=8, help="one-at-a-time streams")
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--model", default=None, help="default: the bundled SmolLM2-135M")
    parser.add_argument("--server-args", default="", help="extra flags for every server")
    parser.add_argument("--json", default="bench_results/data_parallel.json")
    args = parser.parse_args()

    config = EngineConfig(model=args.model)
    extra = shlex.split(args.server_args)
    tokenizer = load_tokenizer(args.model)
    servers: dict[str, ServerProcess] = {}
    runs: list[Run] = []
    print(f"{'round':>5s} {'server':>6s} {'phase':>13s} {'out tok/s':>9s} {'TTFT p50':>9s} "
          f"{'TTFT p99':>9s} {'TPOT p50':>9s} {'TPOT p99':>9s} {'failed':>6s}")  # fmt: skip
    try:
        for name, flags in SERVERS.items():
            servers[name] = launch_server(config, extra_args=[*flags, *extra])
        for index in range(args.rounds):
            plan = [
                ("dp2", "load", args.requests, args.concurrency),
                ("single", "load", args.requests, args.concurrency),
                ("single", "one-at-a-time", args.overhead_requests, 1),
                ("ray1", "one-at-a-time", args.overhead_requests, 1),
            ]
            for name, phase, count, concurrency in plan:
                spec = WorkloadSpec(
                    num_requests=count,
                    input_len=args.prompt_len,
                    output_len=args.output_len,
                    seed=index,  # both servers of a phase get the same prompts
                )
                run = Run(index, name, phase, *drive(servers[name], spec, tokenizer, concurrency))
                runs.append(run)
                print(f"{index:5d} {name:>6s} {phase:>13s} {run.output_tok_s:9.1f} "
                      f"{run.ttft_p50_ms:9.1f} {run.ttft_p99_ms:9.1f} {run.tpot_p50_ms:9.2f} "
                      f"{run.tpot_p99_ms:9.2f} {run.failed:6d}", flush=True)  # fmt: skip
    finally:
        for server in servers.values():
            server.stop()
    summary = summarize(runs)
    write_results(
        args.json,
        {"server_args": extra, "summary": summary, "runs": [asdict(r) for r in runs]},
    )


def summarize(runs: list[Run]) -> dict[str, float]:
    """Medians over rounds: dp2 against single under load, and the front end's hop."""

    def median(server: str, phase: str, field: str) -> float:
        values = [getattr(r, field) for r in runs if r.server == server and r.phase == phase]
        return statistics.median(values) if values else float("nan")

    summary = {
        "dp2_output_tok_s": median("dp2", "load", "output_tok_s"),
        "single_output_tok_s": median("single", "load", "output_tok_s"),
    }
    summary["dp2_over_single"] = summary["dp2_output_tok_s"] / summary["single_output_tok_s"]
    for field in ("ttft_p50_ms", "ttft_p99_ms", "tpot_p50_ms", "tpot_p99_ms"):
        summary[f"dp2_{field}"] = median("dp2", "load", field)
        summary[f"single_{field}"] = median("single", "load", field)
    # What the Ray front end adds: once per request (TTFT) and per streamed token (TPOT).
    hop = "one-at-a-time"
    summary["front_end_ttft_added_ms"] = median("ray1", hop, "ttft_p50_ms") - median(
        "single", hop, "ttft_p50_ms"
    )
    summary["front_end_tpot_added_ms"] = median("ray1", hop, "tpot_p50_ms") - median(
        "single", hop, "tpot_p50_ms"
    )
    print(
        f"under load, medians over rounds: dp2 {summary['dp2_output_tok_s']:.1f} output tok/s "
        f"vs single {summary['single_output_tok_s']:.1f} (x{summary['dp2_over_single']:.2f}); "
        f"TTFT p50 {summary['dp2_ttft_p50_ms']:.0f} vs {summary['single_ttft_p50_ms']:.0f} ms, "
        f"p99 {summary['dp2_ttft_p99_ms']:.0f} vs {summary['single_ttft_p99_ms']:.0f} ms; "
        f"TPOT p50 {summary['dp2_tpot_p50_ms']:.1f} vs {summary['single_tpot_p50_ms']:.1f} ms, "
        f"p99 {summary['dp2_tpot_p99_ms']:.1f} vs {summary['single_tpot_p99_ms']:.1f} ms"
    )
    print(
        f"the Ray front end adds {summary['front_end_ttft_added_ms']:+.1f} ms to a request's "
        f"TTFT and {summary['front_end_tpot_added_ms']:+.2f} ms to each token (p50, one "
        "stream at a time, ray1 less single)"
    )
    return summary


if __name__ == "__main__":
    main()
