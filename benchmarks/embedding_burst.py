"""Does a burst of embeddings slow the chat streams beside it? TBT of 8 streams alone, then
the same 8 streams while 200 embedding requests arrive at once, against one real
`iterserve serve` of the bundled model (generation and embeddings from the same process).

Embedding requests run in the scheduler's embed lane, which takes at most
--embed-lane-share of each step's token budget while generation runs
(docs/embeddings.md): the issue's bar is the streams' TBT p99 with the burst within 2x of
their TBT p99 alone. Each round runs both phases, alone first; `--shares 0.125,0.9` runs
a server per share (0.9: nearly unbounded, what the lane's bound buys). Prints, per round,
TBT p50/p99 both ways and their ratio, how long the burst lasted against the streams (the
streams' TBT counts only if the burst covered them), and embeddings/s; the ISA and the load
(the machine is shared: ratios, not absolute times); writes JSON. Asserts nothing.

    .venv/bin/python benchmarks/embedding_burst.py [--rounds 2] [--shares 0.125] \
        [--burst 200] [--embed-len 128] [--output-len 256]
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import os
import subprocess
import time
from dataclasses import asdict, dataclass

import aiohttp

from _results import write_results  # type: ignore[import-not-found]  # run from benchmarks/
from iterserve.bench.client import ClientConfig, reset_prefix_cache, run_client_async
from iterserve.bench.machine import cpu_line
from iterserve.bench.metrics import compute_metrics
from iterserve.bench.server_process import ServerProcess, launch_server
from iterserve.bench.tokenizer import load_tokenizer, ordinary_token_ids
from iterserve.bench.workloads import WorkloadSpec, build_workload
from iterserve.config import EngineConfig


@dataclass
class Phase:
    round: int
    share: float
    burst: bool
    tbt_p50_ms: float
    tbt_p99_ms: float
    streams_seconds: float  # first request sent to the last stream's end
    burst_seconds: float | None = None  # first embedding request sent to the last answered
    embeddings_per_s: float | None = None
    embedding_failures: int = 0
    stream_failures: int = 0


async def embed_burst(base_url: str, prompts: list[list[int]], delay: float) -> tuple[float, int]:
    """All `prompts` as separate /v1/embeddings requests at once, after `delay` seconds;
    returns the seconds from the first sent to the last answered, and the failures."""
    await asyncio.sleep(delay)
    timeout = aiohttp.ClientTimeout(total=3600)
    connector = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(timeout=timeout, connector=connector) as session:

        async def one(ids: list[int]) -> bool:
            async with session.post(f"{base_url}/v1/embeddings", json={"input": ids}) as resp:
                body = await resp.json()
                return resp.status == 200 and len(body["data"]) == 1

        start = time.perf_counter()
        results = await asyncio.gather(*(one(p) for p in prompts))
        return time.perf_counter() - start, sum(not ok for ok in results)


async def run_phase(
    server: ServerProcess,
    spec: WorkloadSpec,
    tokenizer: object,
    burst: list[list[int]] | None,
    delay: float,
) -> tuple[object, float, tuple[float, int] | None]:
    workload = build_workload(spec, tokenizer)
    config = ClientConfig(server.base_url, progress=False)
    start = time.perf_counter()
    ended: list[float] = []

    async def streams() -> object:
        result = await run_client_async(config, workload, [0.0] * len(workload.requests), None)
        ended.append(time.perf_counter() - start)
        return result

    if burst is None:
        return await streams(), ended[0], None
    result, burst_result = await asyncio.gather(
        streams(), embed_burst(server.base_url, burst, delay)
    )
    return result, ended[0], burst_result


def measure(
    server: ServerProcess,
    args: argparse.Namespace,
    tokenizer: object,
    index: int,
    share: float,
    with_burst: bool,
) -> Phase:
    reset_prefix_cache(ClientConfig(server.base_url))
    spec = WorkloadSpec(
        num_requests=args.streams,
        input_len=args.input_len,
        output_len=args.output_len,
        seed=index,
    )
    burst = None
    if with_burst:
        vocab = ordinary_token_ids(tokenizer)
        burst = [
            [vocab[(index * 7919 + r * 131 + i * 17) % len(vocab)] for i in range(args.embed_len)]
            for r in range(args.burst)
        ]
    result, seconds, burst_result = asyncio.run(
        run_phase(server, spec, tokenizer, burst, args.burst_delay)
    )
    metrics = compute_metrics(result.records)  # type: ignore[attr-defined]
    itl = metrics.latency.itl
    nan = float("nan")
    phase = Phase(
        index,
        share,
        with_burst,
        itl.median if itl else nan,  # (ms)
        itl.p99 if itl else nan,
        seconds,
        stream_failures=metrics.throughput.failed,
    )
    if burst_result is not None:
        phase.burst_seconds, phase.embedding_failures = burst_result
        phase.embeddings_per_s = (args.burst - phase.embedding_failures) / burst_result[0]
    return phase


def isa() -> str:
    flags = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
    found = sorted({w for w in flags.split() if w.startswith("avx512") or w == "avx2"})
    return " ".join(found)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument(
        "--shares", default="0.125", help="--embed-lane-share values, comma-separated"
    )
    parser.add_argument("--streams", type=int, default=8)
    parser.add_argument("--input-len", type=int, default=64)
    parser.add_argument("--output-len", type=int, default=256)
    parser.add_argument("--burst", type=int, default=200)
    parser.add_argument("--embed-len", type=int, default=128)
    parser.add_argument(
        "--burst-delay", type=float, default=0.5, help="seconds after the streams start"
    )
    parser.add_argument("--server-args", default="", help="more `iterserve serve` flags")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()

    tokenizer = load_tokenizer(None)
    machine = {
        "isa": isa(),
        "kernels": cpu_line(),
        "date": datetime.date.today().isoformat(),
        "load_before": os.getloadavg(),
    }
    print(f"isa: {machine['isa']}\n{machine['kernels']}\nload: {machine['load_before']}")
    phases: list[Phase] = []
    for share in [float(s) for s in args.shares.split(",")]:
        # The whole burst is queued at once: the waiting bound must not answer it with 429s.
        extra = [
            "--embed-lane-share",
            str(share),
            "--max-waiting-requests",
            str(max(256, 2 * args.burst)),
            *args.server_args.split(),
        ]
        with launch_server(EngineConfig(), extra_args=extra) as server:
            for index in range(args.rounds):
                for with_burst in (False, True):
                    phase = measure(server, args, tokenizer, index, share, with_burst)
                    phases.append(phase)
                    print(_line(phase), flush=True)
    machine["load_after"] = os.getloadavg()
    summary = _summary(phases)
    for line in summary["lines"]:
        print(line)
    out = args.out or f"benchmarks/results/{machine['date']}-embedding_burst.json"
    write_results(
        out,
        {
            "machine": machine,
            "args": vars(args),
            "phases": [asdict(p) for p in phases],
            "summary": summary["ratios"],
        },
    )


def _line(p: Phase) -> str:
    text = (
        f"round {p.round} share {p.share:g} {'burst' if p.burst else 'alone'}: "
        f"TBT p50 {p.tbt_p50_ms:.1f} ms p99 {p.tbt_p99_ms:.1f} ms, streams {p.streams_seconds:.1f} s"
    )
    if p.burst_seconds is not None:
        text += (
            f", burst {p.burst_seconds:.1f} s ({p.embeddings_per_s:.1f} embeddings/s, "
            f"{p.embedding_failures} failed)"
        )
    return text


def _summary(phases: list[Phase]) -> dict[str, object]:
    ratios = []
    lines = []
    for alone, burst in zip(phases[::2], phases[1::2], strict=True):
        p99 = burst.tbt_p99_ms / alone.tbt_p99_ms
        p50 = burst.tbt_p50_ms / alone.tbt_p50_ms
        ratios.append(
            {
                "round": alone.round,
                "share": alone.share,
                "tbt_p99_ratio": p99,
                "tbt_p50_ratio": p50,
                "embeddings_per_s": burst.embeddings_per_s,
            }  # fmt: skip
        )
        lines.append(
            f"share {alone.share:g} round {alone.round}: TBT p99 with burst / alone = {p99:.2f}x "
            f"(p50 {p50:.2f}x; bar: 2x), {burst.embeddings_per_s:.1f} embeddings/s"
        )
    return {"ratios": ratios, "lines": lines}


if __name__ == "__main__":
    main()
