"""What an 8-bit KV pool buys under memory pressure: preemptions and throughput, same memory.

The bundled model serves B concurrent requests (prompts of ordinary tokens, ignore_eos) from
a KV pool of --kv-cache-memory GiB, once with K/V in the model's dtype (`auto`) and once in
int8 (`--kv-cache-dtype int8`, ~1.9x the tokens), alternating, each run to completion. For
each it prints the pool's size in tokens, the preemptions the scheduler had to make (each one
recomputes a sequence's context later), and output tokens per second of the whole batch.
Asserts nothing.

    .venv/bin/python benchmarks/kv_cache_capacity.py [--kv-cache-memory 0.1] [--batch 64] \
        [--prompt-len 256] [--output-len 256] [--json out.json]
"""

from __future__ import annotations

import argparse
import time

import numpy as np

from _results import write_results  # type: ignore[import-not-found]  # run from benchmarks/
from iterserve.bench.machine import cpu_line
from iterserve.bench.tokenizer import load_tokenizer, ordinary_token_ids
from iterserve.engine.llm import LLM
from iterserve.sampling_params import SamplingParams


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--kv-cache-memory", type=float, default=0.1, help="GiB")
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--prompt-len", type=int, default=256)
    parser.add_argument("--output-len", type=int, default=256)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--json", default="bench_results/kv_cache_capacity.json")
    args = parser.parse_args()

    print(cpu_line(), flush=True)
    vocab = np.asarray(ordinary_token_ids(load_tokenizer(None)))
    rng = np.random.default_rng(0)
    prompts = [rng.choice(vocab, size=args.prompt_len).tolist() for _ in range(args.batch)]
    params = SamplingParams(temperature=0.0, max_tokens=args.output_len, ignore_eos=True)
    engines = {
        kind: LLM(
            kv_cache_memory=args.kv_cache_memory,
            kv_cache_dtype=kind,
            max_num_seqs=args.batch,
            enable_prefix_caching=False,  # every round reuses the same prompts
        )
        for kind in ("auto", "int8")
    }
    rows = []
    print(f"{'pool':5s} {'tokens':>7s} {'preemptions':>12s} {'output tok/s':>13s}")
    for _ in range(args.rounds):
        for kind, llm in engines.items():
            scheduler = llm.engine.scheduler
            before = scheduler.num_preemptions
            start = time.perf_counter()
            llm.generate(prompts, params, use_tqdm=False)
            seconds = time.perf_counter() - start
            row = {
                "kv_cache_dtype": kind,
                "pool_tokens": scheduler.kv_cache_stats().num_blocks
                * llm.engine.config.cache.block_size,
                "preemptions": scheduler.num_preemptions - before,
                "output_tok_s": args.batch * args.output_len / seconds,
            }
            rows.append(row)
            print(
                f"{kind:5s} {row['pool_tokens']:7d} {row['preemptions']:12d} "
                f"{row['output_tok_s']:13.1f}",
                flush=True,
            )
    write_results(args.json, {"cpu": cpu_line(), "args": vars(args), "rows": rows})


if __name__ == "__main__":
    main()
