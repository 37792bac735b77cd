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

The buffer sits on 2 MiB pages (`host_memory.weight_buffer`, as iterserve's weights do): on
4 KiB pages the same sum read 45-49 GB/s where 2 MiB pages read 63-65, rounds in turns
(2026-11-30, AMD EPYC Zen 4, 2 cores, avx512bf16; a throwaway script), a TLB walk every 4 KiB
costing a quarter of the speed. Until then this figure was taken on 4 KiB pages, so shares
of it reported before 2026-11-30 are up to 1.3x too high (docs/benchmarks.md). llama.cpp's
weights are its mmapped file's page cache: 4 KiB pages.

One plain stream a thread is not always the most a core can read: on an Intel Xeon VM
(family 6, model 207, 2 cores, avx512bf16; 2026-12-01) the float32 sum read 21-27 GB/s while a
1B's and a 3B's batch-1 decode read more (benchmarks/big_models.py printed shares of
117-143%). So the figure is the faster of that sum and the kernels' `read_probe`, which reads
the buffer as the decode loops read a weight (4 streams a thread side by side, asked for
ahead: kernels/csrc/read_probe.cpp), where the kernels are built.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import TYPE_CHECKING

from iterserve.model.gguf_parts import part_number, part_paths

if TYPE_CHECKING:
    from iterserve.model.config import ModelConfig

BUFFER_BYTES = (
    1 << 30
)  # far beyond any cache here (35.8 MiB of L3 on the machine it was checked on)

METHOD = (
    "the faster of a torch float32 sum and the kernels' 4-stream read (read_probe) over 1 GiB "
    "on 2 MiB pages"
)


def read_bandwidth(threads: int, nbytes: int = BUFFER_BYTES, repeats: int = 10) -> float:
    """Bytes per second that `threads` threads read from memory: the best of `repeats` reads
    of `nbytes` on 2 MiB pages where the system gives them (their pages written first, so no
    page fault is timed), each read both as a float32 `x.sum()` under
    torch.set_num_threads(threads) and, where the kernels are built, as their `read_probe`."""
    import torch

    from iterserve import kernels
    from iterserve.model.host_memory import weight_buffer

    probe = kernels.ops().read_probe if kernels.available() else None
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        buffer = weight_buffer(1, nbytes).view(torch.uint8)
        x = buffer.view(torch.float32).fill_(1.0)
        reads = [x.sum] + ([lambda: probe(buffer, threads)] if probe else [])
        best = float("inf")
        for _ in range(repeats):
            for read in reads:  # in turns, so that both meet the same spells
                start = time.perf_counter()
                read()
                best = min(best, time.perf_counter() - start)
    finally:
        torch.set_num_threads(before)
    return nbytes / best


def decode_bytes_per_token(path: Path) -> int:
    """Bytes of a checkpoint's tensors (a GGUF file, or an HF directory's safetensors) one
    decode step of one sequence reads: every tensor once, but of a mixture of experts'
    stacks (GGUF's ffn_*_exps, HF's experts) only the share of the experts a token is
    routed to; the embedding only when it is also the head (tied, no separate head),
    since otherwise a step reads one row of it (as of Gemma 4's per-layer table). The KV
    cache a step reads is
    `kv_bytes_per_step`'s. (An HF checkpoint's dense weights are counted as stored, bf16,
    though the engine may keep them otherwise.)"""
    config = _config(path)
    experts = config.num_local_experts
    routed = config.num_experts_per_tok / experts if experts else 1.0
    sizes = _tensor_bytes(path)
    head = "output.weight" if path.is_file() else "lm_head.weight"
    embedding = "token_embd.weight" if path.is_file() else "model.embed_tokens.weight"
    looked_up = {embedding} if head in sizes else set()
    looked_up |= {"per_layer_token_embd.weight", "model.embed_tokens_per_layer.weight"}
    return round(
        sum(
            nbytes * (routed if "_exps." in name or ".experts." in name else 1.0)
            for name, nbytes in sizes.items()
            if name not in looked_up
        )
    )


def kv_bytes_per_step(path: Path, context: int, itemsize: int = 2) -> int:
    """Bytes of K and V one decode step of one sequence reads at `context` tokens: every
    layer's rows of them, up to its sliding window, `itemsize` bytes a value (2: the 16-bit
    caches both engines keep by default). Against a 3B's 2 GB of weights that is 0.12 GB at
    1k tokens and 0.47 GB at 4k (Llama 3.2 3B: 112 KiB a token)."""
    config = _config(path)
    # An LFM2 conv layer reads its convolution's rows of the token's predecessors.
    conv = config.hidden_size * itemsize * min(context, config.conv_history)

    def attention(i: int) -> int:
        row = 2 * config.layer_kv_heads(i) * config.layer_head_dim(i) * itemsize  # K and V
        return row * (min(context, window) if (window := config.layer_window(i)) else context)

    return sum(
        conv if config.layer_is_conv(i) else attention(i) for i in range(config.num_hidden_layers)
    )


def checkpoint_bytes(path: Path) -> int:
    """A GGUF model's size (all its parts, if split), or an HF directory's safetensors'."""
    if path.is_file():
        if (number := part_number(path)) is not None:
            return sum(part.stat().st_size for part in part_paths(path, number[1]))
        return path.stat().st_size
    return sum(shard.stat().st_size for shard in path.glob("*.safetensors"))


def _config(path: Path) -> ModelConfig:
    if path.is_file():
        from iterserve.model.gguf_loader import read_gguf_config

        return read_gguf_config(path)
    from iterserve.model.loader import hf_model_config

    return hf_model_config(json.loads((path / "config.json").read_text()))


def _tensor_bytes(path: Path) -> dict[str, int]:
    if path.is_file():
        from iterserve.model.gguf_loader import read_gguf_header

        _, tensors = read_gguf_header(path)
        return {name: info.nbytes for name, info in tensors.items()}
    from iterserve.model.safetensors_mxfp4 import stored_tensors

    return {
        name: stored.nbytes
        for shard in path.glob("*.safetensors")
        for name, stored in stored_tensors(shard).items()
    }
