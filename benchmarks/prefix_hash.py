"""What naming prefix-cache blocks with sha256 costs against Python's hash, per step.

A block is hashed once, when it first fills, so a step hashes at most
(tokens computed this step) / block_size blocks. This times both algorithms
on real-sized blocks and sets the cost against the bundled model's step times as
benchmarks/decode_speed.py measured them (pass yours with --prefill-ms / --decode-ms).

    .venv/bin/python benchmarks/prefix_hash.py
"""

from __future__ import annotations

import argparse
import random
import timeit

from iterserve.core.kv_cache import builtin_block_hash, sha256_block_hash


def per_block_us(hash_block, parent, tokens: list[int], number: int = 100_000) -> float:  # type: ignore[no-untyped-def]
    return timeit.timeit(lambda: hash_block(parent, tokens), number=number) / number * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--prefill-tokens", type=int, default=512)
    parser.add_argument("--prefill-ms", type=float, default=318.0, help="a 512-token prefill step")
    parser.add_argument("--decode-batch", type=int, default=64)
    parser.add_argument("--decode-ms", type=float, default=70.0, help="a batch-64 decode step")
    args = parser.parse_args()

    rng = random.Random(0)
    tokens = [rng.randrange(49152) for _ in range(args.block_size)]
    costs = {
        "builtin": per_block_us(builtin_block_hash, hash(0), tokens),
        "sha256": per_block_us(sha256_block_hash, sha256_block_hash(None, tokens), tokens),
    }
    prefill_blocks = args.prefill_tokens / args.block_size
    # A decode step fills a block for one request in block_size, on average.
    decode_blocks = args.decode_batch / args.block_size
    print(f"block of {args.block_size} tokens")
    print(f"{'algo':<8}{'us/block':>10}{'prefill step':>16}{'decode step':>16}")
    for name, us in costs.items():
        prefill = us * prefill_blocks / (args.prefill_ms * 1e3)
        decode = us * decode_blocks / (args.decode_ms * 1e3)
        print(f"{name:<8}{us:>10.2f}{prefill:>15.4%}{decode:>16.4%}")


if __name__ == "__main__":
    main()
