"""Decode attention over a paged pool: the C++ op (kernels/csrc/paged_attention.cpp) vs torch.

SmolLM2-135M shapes by default (9 query heads, 3 kv heads, head_dim 64, 30 layers; `--shape`
for another model's, e.g. `32,8,64,16` for Llama 3.2 1B), block 16, bf16, each layer with its
own cache (so the pool is as cold as in a real step), blocks handed out from a shuffled free
list. A step is the attention of a batch over all layers: per layer, write the new K/V into
the cache and attend. Each sequence brings one new token (a decode) or `--new-tokens` (a
prompt chunk's rows at the end of its context).

    torch: attention.paged_attention (today's path; its per-step plan, built by the first
           layer from a fresh AttentionMetadata, is inside the timing)
    C++:   kernels.ops(isa).store_and_attend (the cache write and attention, one call per
           layer, as the engine runs it), for each ISA variant asked for (--isa
           avx512bf16,avx2; default: the one the engine would run, which ITERSERVE_ISA
           overrides); with --int8-cache also over an int8 pool of the same values
           (`isa/int8`: --kv-cache-dtype int8, half the bytes)

Per-step metadata (build_attention_metadata for torch; the packed step table and slot
mapping for the op) is built outside the timed step and timed on its own.
All contenders alternate call by call and the medians are printed, each variant with its
speedup over torch in the same run. Nothing is asserted about time: the machine is shared
and noisy; compare numbers from one run.

    PYTHONPATH=src .venv/bin/python benchmarks/attention_kernel.py [--threads 2 | --threads 1 --cpu-time] \
        [--isa avx512bf16,avx2] [--shape 32,8,64,16] [--scenarios 1x1024,16x256] \
        [--new-tokens 128] [--json out.json]

Two builds of the kernels (a change and main) compare by running this twice in turns, each
with its own source tree on PYTHONPATH and its own ITERSERVE_CACHE_DIR.
"""

from __future__ import annotations

import argparse
import dataclasses
import random
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import torch

from _results import write_results  # type: ignore[import-not-found]  # run from benchmarks/
from _timing import interleaved, one_round  # type: ignore[import-not-found]
from iterserve import kernels
from iterserve.bench.machine import cpu_line
from iterserve.model.attention import paged_attention
from iterserve.model.attention_metadata import SeqSpan, build_attention_metadata
from iterserve.model.kv_cache_format import quantize_rows

BLOCK_SIZE, DTYPE = 16, torch.bfloat16
CPU = torch.device("cpu")
SCENARIOS = [(b, c) for c in (256, 1024) for b in (1, 8, 32, 64)] + [(1, 4096)]


@dataclasses.dataclass(frozen=True)
class Shape:
    heads: int = 9  # SmolLM2-135M's
    kv_heads: int = 3
    head_dim: int = 64
    layers: int = 30

    @classmethod
    def parse(cls, text: str) -> Shape:
        """'heads,kv_heads,head_dim[,layers]'."""
        return cls(*(int(x) for x in text.split(",")))

    @property
    def scale(self) -> float:
        return self.head_dim**-0.5


def make_pool(shape: Shape, num_blocks: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Per layer (K, V) caches, each its own memory; one random layer copied to the rest."""
    first = torch.randn(shape.kv_heads, num_blocks, BLOCK_SIZE, shape.head_dim).to(DTYPE)
    return [(first.clone(), first.clone()) for _ in range(shape.layers)]


def step_spans(batch: int, context: int, new: int, num_blocks: int) -> list[SeqSpan]:
    """`batch` sequences of `context` tokens, the last `new` of each this step's."""
    free = list(range(num_blocks))
    random.Random(batch * 10_000 + context).shuffle(free)  # scattered, as after hours of churn
    per_seq = -(-context // BLOCK_SIZE)
    return [
        SeqSpan(tuple(free[i * per_seq : (i + 1) * per_seq]), context - new, new)
        for i in range(batch)
    ]


def kernel_metadata(spans: list[SeqSpan]) -> tuple[torch.Tensor, torch.Tensor]:
    """What the op takes: the packed step table and the slot mapping."""
    meta = build_attention_metadata(spans, BLOCK_SIZE, CPU, paged_kernel=True)
    assert meta.kernel is not None
    return meta.kernel.packed, meta.slot_mapping


def steps(
    shape: Shape, batch: int, context: int, new: int, isas: list[str], int8_cache: bool
) -> tuple[dict[str, Callable[[], list[torch.Tensor]]], dict[str, float], Callable[[], None]]:
    num_blocks = batch * -(-context // BLOCK_SIZE) + 4
    pool = make_pool(shape, num_blocks)
    int8_pool = [(quantize_rows(k), quantize_rows(v)) for k, v in pool] if int8_cache else []
    spans = step_spans(batch, context, new, num_blocks)
    rows, d = batch * new, shape.head_dim
    qkv = torch.randn(rows, (shape.heads + 2 * shape.kv_heads) * d).to(DTYPE)
    q, k, v = qkv.split([shape.heads * d, shape.kv_heads * d, shape.kv_heads * d], 1)
    q = q.view(rows, shape.heads, d)
    k = k.view(rows, shape.kv_heads, d)
    v = v.view(rows, shape.kv_heads, d)

    meta = build_attention_metadata(spans, BLOCK_SIZE, CPU)
    step_table, slots = kernel_metadata(spans)

    def torch_step() -> list[torch.Tensor]:
        step_meta = dataclasses.replace(meta, plans={})  # the plan is rebuilt every step
        return [paged_attention(q, k, v, kv, step_meta, shape.scale) for kv in pool]

    def kernel_step(
        isa: str, layers: list[tuple[torch.Tensor, torch.Tensor]]
    ) -> Callable[[], list[torch.Tensor]]:
        store_and_attend = kernels.ops(isa).store_and_attend

        def step() -> list[torch.Tensor]:
            return [
                store_and_attend(q, k, v, *kv, slots, step_table, shape.scale, 0) for kv in layers
            ]

        return step

    def release() -> None:
        pool.clear()
        int8_pool.clear()

    metadata_us = {
        "torch": timed(lambda: build_attention_metadata(spans, BLOCK_SIZE, CPU)) * 1e6,
        "C++": timed(lambda: kernel_metadata(spans)) * 1e6,
    }
    fns = {"torch": torch_step} | {isa: kernel_step(isa, pool) for isa in isas}
    if int8_cache:
        fns |= {f"{isa}/int8": kernel_step(isa, int8_pool) for isa in isas}
    return fns, metadata_us, release


def timed(fn: Callable[[], object], repeats: int = 50) -> float:
    fn()
    samples = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - start)
    return statistics.median(samples)


def interleaved_within(
    fns: dict[str, Callable[[], object]], seconds: float, cpu_time: bool = False
) -> dict[str, float]:
    """Median seconds per call, over as many interleaved rounds (5 to 40) as fit `seconds`;
    thread CPU time instead of wall time if `cpu_time`."""
    one_round(fns)  # warm up
    repeats = max(5, min(40, int(seconds / max(one_round(fns), 1e-6))))
    return interleaved(fns, repeats, time.thread_time if cpu_time else time.perf_counter)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument(
        "--cpu-time",
        action="store_true",
        help="time by this thread's CPU time (needs --threads 1): steadier on a loaded machine",
    )
    parser.add_argument("--seconds", type=float, default=2.5, help="timing budget per scenario")
    parser.add_argument(
        "--isa",
        default=None,
        help="kernel variants to time, comma-separated (default: the selected one)",
    )
    parser.add_argument(
        "--int8-cache", action="store_true", help="also time each variant over an int8 pool"
    )
    parser.add_argument(
        "--shape",
        type=Shape.parse,
        default=Shape(),
        help="heads,kv_heads,head_dim[,layers] (default: SmolLM2-135M's 9,3,64,30)",
    )
    parser.add_argument(
        "--scenarios",
        default=None,
        help="batch x context pairs, e.g. 1x1024,16x256 (default: 1, 8, 32, 64 x 256 and 1,024, "
        "and 1 x 4,096)",
    )
    parser.add_argument(
        "--new-tokens", type=int, default=1, help="new rows a sequence (1: decode; more: a chunk)"
    )
    parser.add_argument("--json", type=Path, default=None, help="also write the results here")
    args = parser.parse_args()
    shape: Shape = args.shape
    scenarios = (
        [tuple(int(x) for x in pair.split("x")) for pair in args.scenarios.split(",")]
        if args.scenarios
        else SCENARIOS
    )
    if args.cpu_time and args.threads != 1:
        parser.error("--cpu-time times this thread alone: use it with --threads 1")
    torch.set_num_threads(args.threads)
    variants = args.isa.split(",") if args.isa else [kernels.isa() or ""]
    for isa in variants:
        if not kernels.available(isa):
            raise SystemExit(f"C++ kernels {isa} unavailable: {kernels.why_unavailable(isa)}")
    isas = variants + [f"{isa}/int8" for isa in variants] if args.int8_cache else variants

    print(cpu_line())
    print(
        f"attention, {args.new_tokens} new token(s) a sequence, {shape.layers} layers,"
        f" {shape.heads}q/{shape.kv_heads}kv heads, head_dim {shape.head_dim},"
        f" block {BLOCK_SIZE}, bf16, {args.threads} threads"
    )
    print(
        f"ms per step ({shape.layers} layers: cache write + attention), medians of interleaved calls;"
    )
    print("speedup: torch ms / the variant's ms; max|diff|: largest difference from torch")
    print("(for an int8 pool, mostly the 8-bit rounding of K and V);")
    print("metadata: per-step metadata build, us (outside the step)")
    columns = "".join(f" {isa + ' ms':>15} {'speedup':>8} {'max|diff|':>10}" for isa in isas)
    print(f"{'batch':>6} {'context':>8} {'torch ms':>10}{columns} {'metadata torch/C++ us':>22}")
    results = []
    with torch.inference_mode():
        for batch, context in scenarios:
            fns, metadata_us, release = steps(
                shape, batch, context, args.new_tokens, variants, args.int8_cache
            )
            expected = fns["torch"]()
            diff = {
                isa: max(
                    (a.float() - b.float()).abs().max().item()
                    for a, b in zip(expected, fns[isa](), strict=True)
                )
                for isa in isas
            }
            timed_ms = interleaved_within(fns, args.seconds, args.cpu_time)
            ms = {name: t * 1e3 for name, t in timed_ms.items()}
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
        write_results(args.json, results)


if __name__ == "__main__":
    main()
