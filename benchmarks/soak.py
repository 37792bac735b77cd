"""Disconnect soak: many streaming clients, a third of them hanging up mid-stream.

Sends `--num-requests` streaming completions as a Poisson process over `--duration`
seconds; each client picked to drop (`--drop-fraction`) closes its connection after a
random number of chunks. Afterwards it checks, and prints:

- the KV pool's used blocks are back to zero (blocks only named in the prefix cache
  are free, so they do not count);
- no request is left running or waiting;
- the server's resident memory did not keep growing (sampled all along: start, peak,
  end, and the slope over the second half of the run), less the KV pool's blocks written
  so far: a pool is reserved whole but resident only as its blocks are first written, and
  with prefix caching every block is written once before a named one is reused, so a large
  pool's (`--kv-cache-memory auto`) pages come in for as long as it takes to go round. The
  slope allowed is `--max-rss-slope`, or in a short run what one allocator step of
  `--rss-step` MiB could fit to;
- every client that did not drop got its whole answer (ignore_eos, so exactly
  max_tokens tokens and finish_reason "length").

It starts its own server (engine flags as for `iterserve serve`) unless given
`--base-url`; memory is then read from `--pid` if given. Measures, prints and writes
JSON (`--json`); the exit code says whether every check held.

    .venv/bin/python benchmarks/soak.py                          # 1,000 requests, ~10 min
    .venv/bin/python benchmarks/soak.py --num-requests 200 --duration 120 --model DIR
"""

from __future__ import annotations

import argparse
import asyncio
import random
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from _results import write_results  # type: ignore[import-not-found]  # run from benchmarks/
from iterserve.bench.client import parse_sse_line
from iterserve.bench.server_process import launch_server, scrape_metrics
from iterserve.bench.tokenizer import load_tokenizer, ordinary_token_ids
from iterserve.config import add_engine_args, engine_config_from_args


@dataclass
class ClientResult:
    dropped: bool  # this client meant to hang up early
    expected_tokens: int
    tokens: int = 0  # completion_tokens from usage, else chunks seen
    finish_reason: str | None = None
    error: str = ""

    @property
    def complete(self) -> bool:
        return (
            not self.error
            and self.finish_reason == "length"
            and self.tokens == self.expected_tokens
        )


@dataclass
class MemoryTrace:
    pid: int | None
    base_url: str
    # (seconds, resident MiB, MiB of the KV pool written so far)
    samples: list[tuple[float, float, float]] = field(default_factory=list)

    async def sample(self, now: float) -> None:
        if self.pid is None:
            return
        try:
            status = Path(f"/proc/{self.pid}/status").read_text()
        except OSError:
            return
        metrics = await asyncio.to_thread(scrape_metrics, self.base_url)
        written = metrics.get("iterserve:kv_cache_written_bytes", 0.0) / 2**20
        for line in status.splitlines():
            if line.startswith("VmRSS:"):
                self.samples.append((now, int(line.split()[1]) / 1024, written))

    def second_half_minutes(self) -> float:
        half = self.samples[len(self.samples) // 2 :]
        return (half[-1][0] - half[0][0]) / 60.0 if len(half) > 1 else 0.0

    def second_half_slope(self) -> float | None:
        """Least-squares MiB per minute over the second half of the samples, of the
        resident memory less the KV pool's written blocks."""
        half = [(t, rss - pool) for t, rss, pool in self.samples[len(self.samples) // 2 :]]
        if len(half) < 3:
            return None
        n = len(half)
        mean_t = sum(t for t, _ in half) / n
        mean_m = sum(m for _, m in half) / n
        var = sum((t - mean_t) ** 2 for t, _ in half)
        cov = sum((t - mean_t) * (m - mean_m) for t, m in half)
        return 60.0 * cov / var if var else None


async def one_client(
    http: httpx.AsyncClient,
    body: dict,
    result: ClientResult,
    drop_after: int,
) -> None:
    try:
        async with http.stream("POST", "/v1/completions", json=body) as response:
            if response.status_code != 200:
                result.error = f"HTTP {response.status_code}"
                return
            chunks = 0
            async for line in response.aiter_lines():
                chunk = parse_sse_line(line)
                if chunk is None:
                    continue
                if "error" in chunk:
                    result.error = str(chunk["error"])[:200]
                    return
                for choice in chunk.get("choices") or []:
                    chunks += 1
                    result.finish_reason = choice.get("finish_reason") or result.finish_reason
                if chunk.get("usage"):
                    result.tokens = int(chunk["usage"]["completion_tokens"])
                if result.dropped and chunks >= drop_after:
                    return  # leaving the block closes the connection mid-stream
            result.tokens = result.tokens or chunks
    except httpx.HTTPError as err:
        result.error = f"{type(err).__name__}: {err}"[:200]


def lane_total(metrics: dict[str, float], name: str) -> float:
    return sum(v for k, v in metrics.items() if k.startswith(f"iterserve:{name}{{"))


async def soak(args: argparse.Namespace, base_url: str, memory: MemoryTrace) -> list[ClientResult]:
    rng = random.Random(args.seed)
    vocab = ordinary_token_ids(load_tokenizer(args.model))
    rate = args.num_requests / args.duration
    results: list[ClientResult] = []
    tasks = []
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    async with httpx.AsyncClient(base_url=base_url, timeout=600, limits=limits) as http:
        start = time.monotonic()
        next_sample = 0.0
        for i in range(args.num_requests):
            await asyncio.sleep(rng.expovariate(rate))
            now = time.monotonic() - start
            if now >= next_sample:
                await memory.sample(now)
                next_sample = now + args.memory_interval
            max_tokens = rng.randint(args.min_tokens, args.max_tokens)
            result = ClientResult(rng.random() < args.drop_fraction, max_tokens)
            body = {
                "prompt": rng.choices(vocab, k=rng.randint(args.min_prompt, args.max_prompt)),
                "max_tokens": max_tokens,
                "temperature": rng.choice([0.0, 0.8]),
                "ignore_eos": True,
                "stream": True,
                "stream_options": {"include_usage": True},
            }
            results.append(result)
            drop_after = rng.randint(0, max_tokens - 1)
            tasks.append(asyncio.create_task(one_client(http, body, result, drop_after)))
            if (i + 1) % 100 == 0:
                print(f"  {i + 1} requests sent at {now:.0f} s", file=sys.stderr)
        while not all(task.done() for task in tasks):
            await memory.sample(time.monotonic() - start)
            await asyncio.sleep(min(args.memory_interval, 1.0))
        await memory.sample(time.monotonic() - start)
    return results


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--base-url", default=None, help="a running server (default: start one)")
    parser.add_argument("--pid", type=int, default=None, help="its process id, for memory")
    parser.add_argument("--num-requests", type=int, default=1000)
    parser.add_argument("--duration", type=float, default=600.0, help="seconds of arrivals")
    parser.add_argument("--drop-fraction", type=float, default=1 / 3)
    parser.add_argument("--min-prompt", type=int, default=16)
    parser.add_argument("--max-prompt", type=int, default=128)
    parser.add_argument("--min-tokens", type=int, default=16)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--memory-interval", type=float, default=5.0, help="seconds")
    parser.add_argument(
        "--max-rss-slope", type=float, default=2.0, help="MiB/min allowed over the second half"
    )
    parser.add_argument(
        "--rss-step", type=float, default=8.0,
        help="MiB one step of the allocator's may add in the second half: the slope allowed "
             "is at least what one such step fits to (1.5 x this / the half's minutes)",
    )  # fmt: skip
    parser.add_argument("--soak-seed", dest="seed", type=int, default=0)
    parser.add_argument("--json", default="bench_results/soak.json")
    add_engine_args(parser)
    args = parser.parse_args()

    server = None
    if args.base_url is None:
        print("starting a server ...", file=sys.stderr)
        server = launch_server(engine_config_from_args(args))
        base_url, pid = server.base_url, server.process.pid
    else:
        base_url, pid = args.base_url.rstrip("/"), args.pid
    memory = MemoryTrace(pid, base_url)
    try:
        before = scrape_metrics(base_url)
        started = time.monotonic()
        results = asyncio.run(soak(args, base_url, memory))
        elapsed = time.monotonic() - started

        def settled() -> bool:
            m = scrape_metrics(base_url)
            return (
                lane_total(m, "num_requests_running") == lane_total(m, "num_requests_waiting") == 0
            )

        deadline = time.monotonic() + 60
        while not settled() and time.monotonic() < deadline:
            time.sleep(0.5)
        after = scrape_metrics(base_url)
    finally:
        if server is not None:
            server.stop()
    return report(args, results, elapsed, before, after, memory)


def report(
    args: argparse.Namespace,
    results: list[ClientResult],
    elapsed: float,
    before: dict[str, float],
    after: dict[str, float],
    memory: MemoryTrace,
) -> int:
    def moved(name: str) -> float:
        return after.get(name, 0.0) - before.get(name, 0.0)

    stayed = [r for r in results if not r.dropped]
    dropped = [r for r in results if r.dropped]
    incomplete = [r for r in stayed if not r.complete]
    running = lane_total(after, "num_requests_running")
    waiting = lane_total(after, "num_requests_waiting")
    used_blocks = after.get("iterserve:kv_cache_used_blocks", float("nan"))
    print(f"\ndisconnect soak: {len(results)} streaming requests in {elapsed:.0f} s")
    print(
        f"  clients that stayed:    {len(stayed)}, complete answers: {len(stayed) - len(incomplete)}"
    )
    for r in incomplete[:5]:
        print(
            f"    incomplete: {r.tokens}/{r.expected_tokens} tokens, {r.finish_reason}, {r.error}"
        )
    print(f"  clients that dropped:   {len(dropped)}")
    print(f"  server: aborted {moved('iterserve:requests_aborted_total'):.0f}, "
          f"finished {sum(moved(k) for k in after if k.startswith('iterserve:requests_finished_total')):.0f}, "
          f"failed {moved('iterserve:requests_failed_total'):.0f}")  # fmt: skip
    print(f"  afterwards: running {running:.0f}, waiting {waiting:.0f}, "
          f"KV blocks used {used_blocks:.0f} of {after.get('iterserve:kv_cache_total_blocks', 0):.0f} "
          f"({after.get('iterserve:kv_cache_cached_blocks', 0):.0f} named in the prefix cache)")  # fmt: skip
    slope = memory.second_half_slope()
    # Growth without bound shows as a steady climb after warm-up; allocator noise does not,
    # but one step of it (a few MiB, once) reads as a slope in a short window: a step of S
    # MiB at a share p of a window of T minutes fits a slope of 6 S p (1 - p) / T, at most
    # 1.5 S / T. 400 requests over 5 minutes read +2.43 MiB/min from one 8.5 MiB step a
    # fifth into the second half (2026-12-06), flat before and after it.
    minutes = memory.second_half_minutes()
    bound = max(args.max_rss_slope, 1.5 * args.rss_step / minutes if minutes else 0.0)
    if memory.samples:
        rss = [m for _, m, _ in memory.samples]
        pool = [p for _, _, p in memory.samples]
        print(f"  server RSS (MiB): start {rss[0]:.0f}, peak {max(rss):.0f}, end {rss[-1]:.0f}; "
              f"of it the KV pool's written blocks {pool[0]:.0f} -> {pool[-1]:.0f} "
              f"(of {after.get('iterserve:kv_cache_memory_bytes', 0) / 2**20:.0f} reserved)")  # fmt: skip
        print(f"  RSS less the pool's written blocks: second-half slope "
              f"{slope if slope is not None else float('nan'):+.2f} MiB/min ({len(rss)} samples; "
              f"at most {bound:.2f} allowed over its {minutes:.1f} min)")  # fmt: skip
    else:
        print("  server RSS: not sampled (pass --pid with --base-url)")
    ok = not incomplete and running == waiting == used_blocks == 0
    if slope is not None and slope > bound:
        ok = False
        print(f"  memory still climbing faster than {bound:.2f} MiB/min")
    print("  all checks held" if ok else "  CHECKS FAILED")
    write_results(
        args.json,
        {
            "model": args.model or "(the bundled model)",
            "requests": len(results),
            "seconds": elapsed,
            "stayed": len(stayed),
            "incomplete": len(incomplete),
            "dropped": len(dropped),
            "kv_blocks_used_after": used_blocks,
            "kv_cache_memory_bytes": after.get("iterserve:kv_cache_memory_bytes"),
            "rss_less_written_pool_slope_mib_per_min": slope,
            "rss_slope_bound_mib_per_min": bound,
            "memory_samples": [
                {"seconds": t, "rss_mib": rss, "kv_written_mib": pool}
                for t, rss, pool in memory.samples
            ],
            "checks_held": ok,
        },
    )
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
