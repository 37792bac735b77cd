"""The qk blocks' kernels against the int8 copy, 1 thread, at the few rows that decide
MAX_QUANTIZED_ROWS in model/linear.py: all 30 layers' projections of SmolLM2-135M's shapes
(random K-quant-like blocks at 4, 5 and 6 bits; more bytes than the L3 cache), in us a layer.

Times are the minimum over rounds of the thread's CPU time (time.thread_time), not wall
medians as benchmarks/linear_kernels.py takes them: on a machine shared with other jobs the
wall clock of one thread swings 10x, its CPU time far less.

    .venv/bin/python benchmarks/qk_rows.py [--rows 1,2,4]
    ITERSERVE_ISA=avx2 .venv/bin/python benchmarks/qk_rows.py
"""

from __future__ import annotations

import argparse
import time

import torch

from iterserve import kernels
from iterserve.model import quant
from linear_kernels import LAYERS, NO_LIMIT, SHAPES, random_kquant

ROUNDS = 15


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", default="1,2,4")
    args = parser.parse_args()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    op = kernels.ops().tiled_linear.default
    formats: dict[str, tuple[list[list[tuple[torch.Tensor, torch.Tensor]]], int]] = {}
    for bits in (4, 5, 6):
        blocks = [[random_kquant(n, k, bits) for n, k in SHAPES] for _ in range(LAYERS)]
        zero = 256 * (32 if bits == 6 else 0)
        formats[f"qk{bits}-int8"] = ([[w.tiles() for w in ws] for ws in blocks], 5 + zero)

    def i8(n: int, k: int) -> tuple[torch.Tensor, torch.Tensor]:
        q, scales = quant.quantize_int8((torch.randn(n, k) * 0.02).bfloat16())
        return quant.tile_int8(q), scales

    formats["i8"] = ([[i8(n, k) for n, k in SHAPES] for _ in range(LAYERS)], 3)
    print(f"kernels: {kernels.isa()}; us a layer (4 projections), 1 thread, min CPU time")
    for rows in [int(r) for r in args.rows.split(",")]:
        xs = [torch.randn(rows, k, dtype=torch.bfloat16) for _, k in SHAPES]
        best: dict[str, float] = {}
        for _ in range(ROUNDS):
            for name, (layers, code) in formats.items():
                start = time.thread_time_ns()
                for layer in layers:
                    for x, (tiles, scales) in zip(xs, layer, strict=True):
                        op(x, tiles, scales, None, None, code, None, None, 0, NO_LIMIT)
                spent = (time.thread_time_ns() - start) / 1e3 / len(layers)
                best[name] = min(best.get(name, float("inf")), spent)
        print(f"{rows:3d} rows  " + "  ".join(f"{k} {v:.0f}" for k, v in best.items()), flush=True)


if __name__ == "__main__":
    main()
