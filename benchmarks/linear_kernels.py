"""The projections of a real-size model's layers in every weight format, row count by row count.

For each format (GGUF block types kept as the file has them, and dense bf16) and each row
count M (tokens in a step), it times --layers layers' four projections of a --body (Llama
3.2 1B by default: qkv 3072 x 2048, o 2048 x 2048, gate_up 16384 x 2048, down 2048 x 8192),
each layer its own weights, so that nothing stays in cache from one call to the next (4 layers
of a 1B are ~140 MB in Q4_K against a 36 MB L3 here), and prints:

  ms        a pass over all the layers' projections
  GB/s      weight bytes read / time: at few rows what the step answers to
  share     GB/s against the machine's read bandwidth with the same threads (measured first,
            iterserve.bench.bandwidth)
  GOP/s     2 M N K / time: at many rows what the step answers to

Weights are random blocks with real-size scales (bench/shaped_gguf.py), on 2 MiB pages
as the engine holds them (model/host_memory.py); `--pages 4k,2m` runs each format both on
ordinary 4 KiB pages and on huge pages, to show what those are worth. Medians of
interleaved repeats, so a noisy spell hits every format alike; asserts nothing. The kernels
run in the ISA variant the CPU picks or ITERSERVE_ISA names (printed first).

    .venv/bin/python benchmarks/linear_kernels.py [--rows 1,4,16,64,512] [--formats Q4_K,Q6_K]
        [--body llama-8b --layers 2] [--body gemma4-e2b] [--pages 4k,2m]
    ITERSERVE_ISA=avx2 .venv/bin/python benchmarks/linear_kernels.py
"""

from __future__ import annotations

import argparse

import numpy as np
import torch

from _results import write_results  # type: ignore[import-not-found]  # run from benchmarks/
from _timing import interleaved, one_round  # type: ignore[import-not-found]
from iterserve import kernels
from iterserve.bench.bandwidth import read_bandwidth
from iterserve.bench.machine import cpu_line
from iterserve.bench.shaped_gguf import random_blocks
from iterserve.model import block_formats as bf
from iterserve.model.host_memory import weight_buffer

# (qkv, o, gate_up, down) as [N, K] of each body.
BODIES = {
    "llama-1b": [(3072, 2048), (2048, 2048), (16384, 2048), (2048, 8192)],
    "llama-8b": [(6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336)],
    "smollm2-135m": [(960, 576), (576, 576), (3072, 576), (576, 1536)],
    "gemma4-e2b": [(2560, 1536), (1536, 2048), (12288, 1536), (1536, 6144)],
}
FORMATS = ["Q4_0", "Q4_K", "Q5_K", "Q6_K", "Q8_0", "IQ4_XS", "Q3_K", "Q2_K", "bf16"]


def random_tiles(
    fmt: str, n: int, k: int, rng: np.random.Generator, pages: str
) -> tuple[torch.Tensor, int]:
    if fmt == "bf16":
        tiles, code = bf.tile_dense((torch.randn(n, k) * 0.02).bfloat16())
    else:
        block = bf.BLOCK_FORMATS[fmt]
        if k % block.inputs:
            raise ValueError(f"{fmt} needs rows of whole {block.inputs}-input blocks, not {k}")
        # Random bits, but for scales of a real model's size: an MXFP4 block's exponent
        # byte drawn from all 256 made subnormal products, whose slow path cost MXFP4 a
        # tenth of its speed here (71% of the bandwidth against 80%).
        raw = random_blocks(fmt, n, k, rng)
        tiles, code = bf.repack(kernels.ops(), raw, block, k), block.code
    held = weight_buffer(*tiles.shape) if pages == "2m" else torch.empty_like(tiles)
    return held.copy_(tiles), code


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", default="1,4,16,64,512")
    parser.add_argument("--formats", default=",".join(FORMATS))
    parser.add_argument("--body", default="llama-1b", choices=sorted(BODIES))
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--pages", default="2m", help="4k, 2m or both: 4k,2m")
    parser.add_argument("--json", default="bench_results/linear_kernels.json")
    args = parser.parse_args()
    if not kernels.available():
        raise SystemExit(f"the kernels do not run here: {kernels.why_unavailable()}")
    threads = torch.get_num_threads()
    print(cpu_line())
    print(f"kernels: {kernels.isa()}, {threads} threads, body {args.body} x {args.layers} layers")
    bandwidth = read_bandwidth(threads)
    print(f"read bandwidth: {bandwidth / 1e9:.1f} GB/s")
    rng = np.random.default_rng(0)
    shapes = BODIES[args.body]
    pages = args.pages.split(",")
    # A contender is a format on a page size ("Q4_K", or "Q4_K 4k" when both are run).
    formats = [
        fmt if len(pages) == 1 else f"{fmt} {page}"
        for fmt in args.formats.split(",")
        for page in pages
    ]
    weights = {
        name: [
            [random_tiles(name.split()[0], n, k, rng, page) for n, k in shapes]
            for _ in range(args.layers)
        ]
        for name, page in zip(formats, pages * len(args.formats.split(",")), strict=True)
    }
    ops = kernels.ops()
    results = []
    print(f"{'rows':>4}  {'format':11} {'ms':>9} {'GB/s':>6} {'share':>6} {'GOP/s':>7}")
    for rows in (int(r) for r in args.rows.split(",")):
        xs = {k: torch.randn(rows, k, dtype=torch.bfloat16) for _, k in shapes}

        def run(fmt: str, xs: dict[int, torch.Tensor] = xs) -> None:
            for layer in weights[fmt]:
                for (tiles, code), (_, k) in zip(layer, shapes, strict=True):
                    ops.tiled_linear(xs[k], [tiles], [code], None, None, False)

        fns = {fmt: (lambda f=fmt: run(f)) for fmt in formats}
        one_round(fns)
        seconds = interleaved(fns, args.repeats)
        flops = 2 * rows * args.layers * sum(n * k for n, k in shapes)
        for fmt in formats:
            nbytes = sum(t.numel() for layer in weights[fmt] for t, _ in layer)
            s = seconds[fmt]
            gbs = nbytes / s / 1e9
            print(
                f"{rows:4d}  {fmt:11} {s * 1e3:9.2f} {gbs:6.1f} {gbs * 1e9 / bandwidth:6.0%} "
                f"{flops / s / 1e9:7.0f}",
                flush=True,
            )
            results.append(
                {
                    "rows": rows,
                    "format": fmt,
                    "ms": s * 1e3,
                    "gb_per_s": gbs,
                    "share": gbs * 1e9 / bandwidth,
                }
            )
    write_results(
        args.json,
        {
            "isa": kernels.isa(),
            "threads": threads,
            "body": args.body,
            "pages": pages,
            "bandwidth": bandwidth,
            "results": results,
        },
    )


if __name__ == "__main__":
    main()
