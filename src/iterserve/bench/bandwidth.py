"""The memory side of a decode step: the machine's read bandwidth, and the bytes a token
reads from a GGUF's weights.

A batch-1 decode of a big model reads every weight once a step and does little arithmetic
on each, so its ceiling is bandwidth / bytes per token; `tok/s x bytes per token /
bandwidth` is the share of that ceiling a run reaches (benchmarks/big_models.py prints it).

How `read_bandwidth` was checked (2026-11-28, Intel Xeon @ 2.50GHz, 2 cores, ISA avx2
avx512f avx512bw avx512cd avx512dq avx512vl avx512_vnni, no avx512_bf16; a throwaway script,
not kept, built with torch.utils.cpp_extension.load_inline): a C++ OpenMP loop adding the
buffer into four AVX-512 (or AVX2) accumulators per thread, each thread over its half or
over interleaved 256 KiB chunks, against torch reductions, over the same 1 GiB, the methods
taking turns round by round (best of 10 and of 15 rounds; the machine was shared):

    GB/s                 1 thread      2 threads
    C++ AVX-512          10.7-11.8     12.8-21.6
    C++ AVX2             10.6-11.1     11.0-20.9
    torch f32 sum        10.6-11.2     12.1-21.1   <- used
    torch f64/int64 sum  10.0-11.3     11.1-20.9
    torch int32 max      8.2-10.7      10.5-20.1
    torch int32 sum      0.5-0.8       0.9-1.2     (a trap: far below the memory)

So a float32 `x.sum()` reads as fast as the C++ loop (within the run-to-run spread); the
2-thread spread is the other tenant: 21 GB/s on a quiet spell, 12 when it held a core.
"""

from __future__ import annotations

import time
from pathlib import Path

BUFFER_BYTES = 1 << 30  # far beyond any cache here (35.8 MiB of L3 on the machine it was checked on)

METHOD = "torch float32 sum over 1 GiB"


def read_bandwidth(threads: int, nbytes: int = BUFFER_BYTES, repeats: int = 10) -> float:
    """Bytes per second that `threads` threads read from memory: the best of `repeats`
    `x.sum()` of a float32 tensor of `nbytes` (its pages written first, so no page fault is
    timed), under torch.set_num_threads(threads)."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        x = torch.ones(nbytes // 4, dtype=torch.float32)
        best = float("inf")
        for _ in range(repeats):
            start = time.perf_counter()
            x.sum()
            best = min(best, time.perf_counter() - start)
    finally:
        torch.set_num_threads(before)
    return x.numel() * 4 / best


def decode_bytes_per_token(path: Path) -> int:
    """Bytes of a GGUF's tensors one decode step reads: every tensor once; the embedding only
    when it is also the head (tied, no output.weight), since otherwise a step reads one row
    of it. The KV cache a step reads is left out (a few MB at the lengths benchmarked)."""
    from iterserve.model.gguf_loader import read_gguf_header

    _, tensors = read_gguf_header(path)
    tied = "output.weight" not in tensors
    return sum(
        info.nbytes for name, info in tensors.items() if tied or name != "token_embd.weight"
    )
