"""Offline throughput: iterserve vs transformers `generate`, same workload, same run.

128 requests, prompt lengths uniform in [32, 512], output lengths uniform in [32, 256]
(ignore_eos, so lengths are exact), the bundled model in bf16, all submitted at once.
transformers runs static padded batches at its best batch size of 8/16/32. Prints both
throughputs and the ratio; writes JSON. Asserts nothing about time.

    .venv/bin/python benchmarks/offline_throughput.py [--num-requests 128] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import math

import numpy as np

from iterserve.bench.arrivals import ArrivalSpec
from iterserve.bench.offline import benchmark_config
from iterserve.bench.peer_transformers import PeerOptions, run_transformers_peer
from iterserve.bench.report import format_report
from iterserve.bench.tokenizer import load_tokenizer, ordinary_token_ids
from iterserve.bench.workloads import Workload, WorkloadRequest
from iterserve.config import CacheConfig, EngineConfig, SchedulerConfig


def build(num_requests: int, seed: int, prompt: tuple[int, int], output: tuple[int, int]):
    vocab = np.asarray(ordinary_token_ids(load_tokenizer(None)))
    rng = np.random.default_rng(seed)

    def request(n_in: int, n_out: int) -> WorkloadRequest:
        return WorkloadRequest(rng.choice(vocab, size=n_in).tolist(), n_out)

    requests = [
        request(
            int(rng.integers(prompt[0], prompt[1] + 1)), int(rng.integers(output[0], output[1] + 1))
        )
        for _ in range(num_requests)
    ]
    return Workload("uniform-offline", requests, warmup=request(16, 4))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--num-requests", type=int, default=128)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--max-num-seqs", type=int, default=128)
    parser.add_argument("--max-num-batched-tokens", type=int, default=512)
    parser.add_argument("--peer-batch-sizes", default="8,16,32")
    parser.add_argument("--skip-peer", action="store_true")
    parser.add_argument("--json", default="bench_results/offline_throughput.json")
    args = parser.parse_args()

    workload = build(args.num_requests, args.seed, (32, 512), (32, 256))
    config = EngineConfig(
        cache=CacheConfig(kv_cache_memory=2.0),
        scheduler=SchedulerConfig(
            max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens
        ),
    )
    report = benchmark_config(config, workload, ArrivalSpec(request_rate=math.inf))
    if not args.skip_peer:
        sizes = [int(s) for s in args.peer_batch_sizes.split(",")]
        report.peer = run_transformers_peer(workload, PeerOptions(batch_sizes=sizes))
    print(format_report(report))
    ours = report.metrics.throughput
    summary = {
        "iterserve": {
            "output_tok_s": ours.output_throughput,
            "total_tok_s": ours.total_token_throughput,
        },
    }
    if report.peer is not None:
        peer = report.peer.throughput
        summary["transformers"] = {
            "batch_size": report.peer.batch_size,
            "output_tok_s": peer.output_throughput,
            "total_tok_s": peer.total_token_throughput,
        }
        summary["ratio_output"] = report.peer_ratio
        print(f"\niterserve / transformers (output tok/s): {report.peer_ratio:.2f}x")
    report.save(args.json)
    with open(args.json) as f:
        data = json.load(f)
    data["summary"] = summary
    with open(args.json, "w") as f:
        json.dump(data, f, indent=2)
    print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
