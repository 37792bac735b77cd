"""Decode attention over a paged pool: the C++ op (kernels/csrc/paged_attention.cpp) vs torch.

SmolLM2-135M shapes (9 query heads, 3 kv heads, head_dim 64), block 16, bf16, 30 layers each
with its own cache (so the pool is as cold as in a real step), blocks handed out from a
shuffled free list. A step is the attention of a decode batch over all layers: per layer,
write the new K/V into the cache and attend.

    torch: attention.paged_attention (today's path; its per-step plan, built by the first
           layer from a fresh AttentionMetadata, is inside the timing)
    C++:   the same cache write + kernels.ops(isa).paged_attention, for each ISA variant
           asked for (--isa avx512bf16,avx2; default: the one the engine would run, which
           ITERSERVE_ISA overrides)

Per-step metadata (build_attention_metadata for torch; int32 block tables, seq_lens and
query_start_loc for the op) is built outside the timed step and timed on its own.
All contenders alternate call by call and the medians are printed, each variant with its
speedup over torch in the same run. Nothing is asserted about time: the machine is shared
and noisy; compare numbers from one run.

    PYTHONPATH=src .venv/bin/python benchmarks/attention_kernel.py [--threads 2] \
        [--isa avx512bf16,avx2] [--json out.json]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import random
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import torch

from iterserve import kernels
from iterserve.model.attention import paged_attention
from iterserve.model.attention_metadata import SeqSpan, build_attention_metadata

NUM_HEADS, NUM_KV_HEADS, HEAD_DIM = 9, 3, 64
NUM_LAYERS, BLOCK_SIZE, DTYPE = 30, 16, torch.bfloat16
SCALE = HEAD_DIM**-0.5
CPU = torch.device("cpu")
SCENARIOS = [(b, c) for c in (256, 1024) for b in (1, 8, 32, 64)] + [(1, 4096)]


def make_pool(num_blocks: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Per layer (K, V) caches, each its own memory; one random layer copied to the rest."""
    shape = (NUM_KV_HEADS, num_blocks, BLOCK_SIZE, HEAD_DIM)
    first = torch.randn(shape).to(DTYPE)
    return [(first.clone(), first.clone()) for _ in range(NUM_LAYERS)]


def decode_spans(batch: int, context: int, num_blocks: int) -> list[SeqSpan]:
    free = list(range(num_blocks))
    random.Random(batch * 10_000 + context).shuffle(free)  # scattered, as after hours of churn
    per_seq = -(-context // BLOCK_SIZE)
    return [
        SeqSpan(tuple(free[i * per_seq : (i + 1) * per_seq]), context - 1, 1) for i in range(batch)
    ]


def kernel_metadata(spans: list[SeqSpan]) -> tuple[torch.Tensor, ...]:
    """What the op takes: block tables, seq_lens, query_start_loc (int32) and slot mapping."""
    lens = [s.num_computed_tokens + s.num_new_tokens for s in spans]
    width = max(len(s.block_ids) for s in spans)
    tables = torch.tensor([[*s.block_ids, *[0] * (width - len(s.block_ids))] for s in spans])
    q_lens = torch.tensor([0, *(s.num_new_tokens for s in spans)])
    last = torch.tensor(lens) - 1
    rows = torch.arange(len(spans))
    slots = tables[rows, last // BLOCK_SIZE] * BLOCK_SIZE + last % BLOCK_SIZE
    return (
        tables.to(torch.int32),
        torch.tensor(lens, dtype=torch.int32),
        q_lens.cumsum(0).to(torch.int32),
        slots,
    )


def write_kv(
    kv: tuple[torch.Tensor, torch.Tensor], k: torch.Tensor, v: torch.Tensor, slots: torch.Tensor
) -> None:
    """The cache write attention.paged_attention does, so both paths pay for it."""
    for cache, new in zip(kv, (k, v), strict=True):
        num_kv_heads, num_blocks, block_size, head_dim = cache.shape
        flat = cache.view(num_kv_heads, num_blocks * block_size, head_dim)
        flat.index_copy_(1, slots, new.transpose(0, 1))


def steps(
    batch: int, context: int, isas: list[str]
) -> tuple[dict[str, Callable[[], list[torch.Tensor]]], dict[str, float], Callable[[], None]]:
    num_blocks = batch * -(-context // BLOCK_SIZE) + 4
    pool = make_pool(num_blocks)
    spans = decode_spans(batch, context, num_blocks)
    qkv = torch.randn(batch, (NUM_HEADS + 2 * NUM_KV_HEADS) * HEAD_DIM).to(DTYPE)
    q, k, v = qkv.split([NUM_HEADS * HEAD_DIM, NUM_KV_HEADS * HEAD_DIM, NUM_KV_HEADS * HEAD_DIM], 1)
    q = q.view(batch, NUM_HEADS, HEAD_DIM)
    k = k.view(batch, NUM_KV_HEADS, HEAD_DIM)
    v = v.view(batch, NUM_KV_HEADS, HEAD_DIM)

    meta = build_attention_metadata(spans, BLOCK_SIZE, CPU)
    tables, lens, starts, slots = kernel_metadata(spans)

    def torch_step() -> list[torch.Tensor]:
        step_meta = dataclasses.replace(meta, plans={})  # the plan is rebuilt every step
        return [paged_attention(q, k, v, kv, step_meta, SCALE) for kv in pool]

    def kernel_step(isa: str) -> Callable[[], list[torch.Tensor]]:
        attend = kernels.ops(isa).paged_attention

        def step() -> list[torch.Tensor]:
            outs = []
            for kv in pool:
                write_kv(kv, k, v, slots)
                outs.append(attend(q, *kv, tables, lens, starts, SCALE, 0))
            return outs

        return step

    def release() -> None:
        pool.clear()

    metadata_us = {
        "torch": timed(lambda: build_attention_metadata(spans, BLOCK_SIZE, CPU)) * 1e6,
        "C++": timed(lambda: kernel_metadata(spans)) * 1e6,
    }
    fns = {"torch": torch_step} | {isa: kernel_step(isa) for isa in isas}
    return fns, metadata_us, release


def timed(fn: Callable[[], object], repeats: int = 50) -> float:
    fn()
    samples = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - start)
    return statistics.median(samples)


def interleaved(fns: dict[str, Callable[[], object]], seconds: float) -> dict[str, float]:
    """Median seconds per call, calls alternating so a noisy spell hits every contender."""
    for fn in fns.values():  # warm up (and size the repeat count)
        fn()
    start = time.perf_counter()
    for fn in fns.values():
        fn()
    repeats = max(5, min(40, int(seconds / max(time.perf_counter() - start, 1e-6))))
    samples: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(repeats):
        for name, fn in fns.items():
            start = time.perf_counter()
            fn()
            samples[name].append(time.perf_counter() - start)
    return {name: statistics.median(times) for name, times in samples.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--seconds", type=float, default=2.5, help="timing budget per scenario")
    parser.add_argument(
        "--isa",
        default=None,
        help="kernel variants to time, comma-separated (default: the selected one)",
    )
    parser.add_argument("--json", type=Path, default=None, help="also write the results here")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    isas = args.isa.split(",") if args.isa else [kernels.isa() or ""]
    for isa in isas:
        if not kernels.available(isa):
            raise SystemExit(f"C++ kernels {isa} unavailable: {kernels.why_unavailable(isa)}")

    print(
        f"decode attention, {NUM_LAYERS} layers, SmolLM2-135M shapes ({NUM_HEADS}q/{NUM_KV_HEADS}kv"
        f" heads, head_dim {HEAD_DIM}), block {BLOCK_SIZE}, bf16, {args.threads} threads"
    )
    print("ms per step (30 layers: cache write + attention), medians of interleaved calls;")
    print("speedup: torch ms / the variant's ms; max|diff|: largest difference from torch;")
    print("metadata: per-step metadata build, us (outside the step)")
    columns = "".join(f" {isa + ' ms':>15} {'speedup':>8} {'max|diff|':>10}" for isa in isas)
    print(f"{'batch':>6} {'context':>8} {'torch ms':>10}{columns} {'metadata torch/C++ us':>22}")
    results = []
    with torch.inference_mode():
        for batch, context in SCENARIOS:
            fns, metadata_us, release = steps(batch, context, isas)
            expected = fns["torch"]()
            diff = {
                isa: max(
                    (a.float() - b.float()).abs().max().item()
                    for a, b in zip(expected, fns[isa](), strict=True)
                )
                for isa in isas
            }
            ms = {name: t * 1e3 for name, t in interleaved(fns, args.seconds).items()}
            release()
            speedup = {isa: ms["torch"] / ms[isa] for isa in isas}
            results.append(
                {"batch": batch, "context": context, "torch_ms": ms["torch"],
                 "kernels": {isa: {"ms": ms[isa], "speedup": speedup[isa], "max_abs_diff": diff[isa]}
                             for isa in isas},
                 "metadata_torch_us": metadata_us["torch"], "metadata_kernel_us": metadata_us["C++"]}
            )  # fmt: skip
            cells = "".join(
                f" {ms[isa]:>15.2f} {speedup[isa]:>7.2f}x {diff[isa]:>10.2g}" for isa in isas
            )
            print(
                f"{batch:>6} {context:>8} {ms['torch']:>10.2f}{cells}"
                f" {metadata_us['torch']:>12.0f} / {metadata_us['C++']:<7.0f}"
            )
    if args.json is not None:
        args.json.write_text(json.dumps(results, indent=2))
        print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
