"""`iterserve serve` against `llama-server --reranking` on the same reranker GGUF, one after
the other: documents reranked a second, a request's latency, the servers' peak memory, and
how far their scores of the same documents agree.

A request is one query and --docs documents of about --doc-words words, the pairs written
into the GGUF's rerank template by each server (llama.cpp's way; iterserve reads the same
template). --requests requests go one at a time, then --concurrency at once. Without --file
it reranks with a random reranker of Qwen3-Reranker-0.6B's shape in Q8_0, which

    .venv/bin/python benchmarks/big_models.py --models qwen3-reranker-0.6b --types Q8_0 \\
        --real-vocab --prepare-only

writes (random weights: the scores say nothing about relevance, only whether the two
engines compute the same numbers). Asserts nothing; prints, and writes JSON.

    .venv/bin/python benchmarks/rerank_vs_llama_server.py [--file FILE.gguf] [--rounds 2]
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import numpy as np

from _results import write_results  # type: ignore[import-not-found]  # run from benchmarks/
from iterserve.bench.machine import cpu_line
from iterserve.bench.server_process import free_port

ROOT = Path(__file__).resolve().parent.parent
DEFAULT_FILE = "~/.cache/iterserve-bench/big_models/qwen3-reranker-0.6b-real-vocab.Q8_0.gguf"
WORDS = [
    *("cat", "dog", "fish", "meat", "market", "stock", "price", "river", "mountain", "city"),
    *("train", "music", "paper", "light", "water", "energy", "garden", "window", "school"),
    *("doctor", "engine", "software", "kernel", "memory", "cache", "token"),
]


def documents(count: int, words: int, seed: int) -> list[str]:
    rng = np.random.default_rng(seed)
    return [" ".join(rng.choice(WORDS, words)) + "." for _ in range(count)]


def start(engine: str, gguf: Path, port: int, slots: int, log: Path) -> subprocess.Popen[bytes]:
    # The same KV capacity in both: llama-server's context is shared by its slots, room for
    # each to hold a whole pair.
    tokens = slots * 2048
    if engine == "iterserve":
        command = [str(ROOT / ".venv/bin/iterserve"), "serve", str(gguf), "--port", str(port)]
        command += ["--num-kv-blocks", str(tokens // 16)]
    else:
        peer = ROOT / "benchmarks/peers/llama_cpp.sh"
        command = [str(peer), "server", str(gguf), str(port), "--reranking"]
        command += ["-np", str(slots), "-c", str(tokens)]
    process = subprocess.Popen(command, stdout=log.open("w"), stderr=subprocess.STDOUT)
    for _ in range(600):
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=1).status_code == 200:
                return process
        except httpx.HTTPError:
            pass
        if process.poll() is not None:
            raise SystemExit(f"{engine} exited while starting: see {log}")
        time.sleep(0.5)
    process.kill()
    raise SystemExit(f"{engine} did not come up: see {log}")


def peak_rss(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    return 0


def rerank(port: int, query: str, docs: list[str]) -> tuple[float, list[float], int]:
    """Seconds, the scores in document order, and the prompt tokens."""
    began = time.perf_counter()
    response = httpx.post(
        f"http://127.0.0.1:{port}/v1/rerank",
        json={"query": query, "documents": docs, "top_n": len(docs)},
        timeout=600,
    )
    seconds = time.perf_counter() - began
    response.raise_for_status()
    body = response.json()
    scores = [0.0] * len(docs)
    for result in body["results"]:
        scores[result["index"]] = result["relevance_score"]
    return seconds, scores, body["usage"]["prompt_tokens"]


def measure(engine: str, gguf: Path, args: argparse.Namespace, log: Path) -> dict[str, Any]:
    port = free_port()
    process = start(engine, gguf, port, args.concurrency, log)
    try:
        # Documents of their own for each phase: none of them is in a prefix cache yet.
        batches = [documents(args.docs, args.doc_words, seed) for seed in range(args.requests)]
        fresh = [documents(args.docs, args.doc_words, 1000 + seed) for seed in range(args.requests)]
        query = "which documents are about cats and fish"
        rerank(port, query, documents(2, args.doc_words, 10**6))  # warm
        one = [rerank(port, query, docs) for docs in batches]
        began = time.perf_counter()
        with ThreadPoolExecutor(args.concurrency) as pool:
            many = list(pool.map(lambda docs: rerank(port, query, docs), fresh))
        wall = time.perf_counter() - began
        # The same documents scored again, beside other requests: does batching move them?
        with ThreadPoolExecutor(args.concurrency) as pool:
            again = list(pool.map(lambda docs: rerank(port, query, docs), batches))
        docs_total = args.docs * args.requests
        return {
            "docs_per_s_one": docs_total / sum(s for s, _, _ in one),
            "docs_per_s_concurrent": docs_total / wall,
            "tokens_per_s_concurrent": sum(t for _, _, t in many) / wall,
            "latency_p50_s": statistics.median(s for s, _, _ in one),
            "prompt_tokens_per_request": one[0][2],
            "tokens_per_s_one": sum(t for _, _, t in one) / sum(s for s, _, _ in one),
            "scores": [scores for _, scores, _ in one],
            # A document's score with other requests beside it against alone (batching).
            "concurrent_vs_alone_max_diff": max(
                abs(x - y)
                for (_, alone, _), (_, beside, _) in zip(one, again, strict=True)
                for x, y in zip(alone, beside, strict=True)
            ),
            "peak_rss": peak_rss(process.pid),
        }
    finally:
        process.terminate()
        process.wait(30)


def agreement(a: list[list[float]], b: list[list[float]]) -> dict[str, float]:
    """Largest score difference, and the share of document pairs both order alike."""
    diff = max(abs(x - y) for ra, rb in zip(a, b, strict=True) for x, y in zip(ra, rb, strict=True))
    same = total = 0
    for ra, rb in zip(a, b, strict=True):
        for i in range(len(ra)):
            for j in range(i + 1, len(ra)):
                total += 1
                same += (ra[i] - ra[j]) * (rb[i] - rb[j]) > 0
    return {"max_abs_diff": diff, "pairs_ordered_alike": same / total}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--file", default=DEFAULT_FILE)
    parser.add_argument("--docs", type=int, default=32, help="documents a request")
    parser.add_argument("--doc-words", type=int, default=120)
    parser.add_argument("--requests", type=int, default=6)
    parser.add_argument("--concurrency", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--json", default="bench_results/rerank_vs_llama_server.json")
    args = parser.parse_args()
    gguf = Path(args.file).expanduser()
    if not gguf.exists():
        raise SystemExit(
            f"{gguf} is missing: see this script's docstring for the command that makes it"
        )
    print(cpu_line())
    logs = Path(args.json).parent
    logs.mkdir(parents=True, exist_ok=True)
    runs: list[dict[str, Any]] = []
    for round_ in range(args.rounds):
        for engine in ("iterserve", "llama.cpp"):
            found = measure(engine, gguf, args, logs / f"rerank-{engine}.log")
            runs.append({"engine": engine, "round": round_, **found})
            print(
                f"{engine:9} round {round_}: {found['docs_per_s_one']:6.1f} docs/s one request at a "
                f"time ({found['tokens_per_s_one']:5.0f} prompt tok/s, p50 {found['latency_p50_s']:.2f} s "
                f"a request of {args.docs}), {found['docs_per_s_concurrent']:6.1f} docs/s "
                f"{args.concurrency} at once (scores moved <= {found['concurrent_vs_alone_max_diff']:.1e}); "
                f"peak RSS {found['peak_rss'] / 2**30:.2f} GiB",
                flush=True,
            )
    ours = [r for r in runs if r["engine"] == "iterserve"]
    theirs = [r for r in runs if r["engine"] == "llama.cpp"]
    ratio_one = statistics.median(
        a["docs_per_s_one"] / b["docs_per_s_one"] for a, b in zip(ours, theirs, strict=True)
    )
    ratio_many = statistics.median(
        a["docs_per_s_concurrent"] / b["docs_per_s_concurrent"]
        for a, b in zip(ours, theirs, strict=True)
    )
    agree = agreement(ours[0]["scores"], theirs[0]["scores"])
    print(
        f"iterserve / llama.cpp: {ratio_one:.2f}x one request at a time, {ratio_many:.2f}x "
        f"{args.concurrency} at once; scores: largest difference {agree['max_abs_diff']:.4f}, "
        f"{agree['pairs_ordered_alike']:.1%} of document pairs ordered alike"
    )
    write_results(
        args.json,
        {"file": str(gguf), "settings": vars(args), "runs": runs, "agreement": agree,
         "ratio_one": ratio_one, "ratio_concurrent": ratio_many},
    )  # fmt: skip


if __name__ == "__main__":
    main()
