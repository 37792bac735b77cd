"""The projections of a whole SmolLM2-135M step, kernel by kernel and row count by row count.

For each row count M (tokens in the step) it times all 30 layers' four projections (each layer
its own weights, so nothing stays in cache from one call to the next) and the tied LM head
(49152 x 576), through:

  torch.mv / F.linear   what a step used before (matrix-vector at one row, GEMM above)
  torch-fp32            F.linear on fp32 copies: what --dtype float32 runs without kernels
  onednn                oneDNN GEMM on weights packed once (mkldnn._linear_pointwise; only
                        where oneDNN has bf16 arithmetic)
  tiled-bf16            csrc/linear.cpp on bf16 weights
  tiled-q4              csrc/linear.cpp on 4-bit blocks (GGUF Q4_1 layout, random values)
  tiled-q8 (head)       csrc/linear.cpp on 8-bit blocks (the bundled GGUF's head is Q8_0)
  tiled-qk4/5/6-int8    csrc/linear.cpp's qk-int8 format (K-quants, Q5_x) at 4, 5 and 6
                        bits on int8 activations (random values; d per 32 inputs, as Q5_0,
                        since K = 576 is not whole 256-input super-blocks)
  tiled-i8              csrc/linear.cpp on int8 weights with int8 activations (W8A8)
  int4pack (torch)      torch's _weight_int4pack_mm_for_cpu, group 32, for comparison

and prints ms per step, the effective weight bandwidth (GB/s) or arithmetic rate (GOP/s
from 512 rows), the largest M at which the tiled bf16 kernel still beats oneDNN, and the
largest at which 4/8-bit weights still beat their int8 copy in the tiled kernel: the source
of MAX_QUANTIZED_ROWS in model/linear.py.
Medians of interleaved repeats; asserts nothing. The kernels run in the ISA variant the CPU
picks or ITERSERVE_ISA names (printed first).

    .venv/bin/python benchmarks/linear_kernels.py [--rows 1,2,4,8,16,32,64] [--json out.json]
    ITERSERVE_ISA=avx2 .venv/bin/python benchmarks/linear_kernels.py
    .venv/bin/python benchmarks/linear_kernels.py --rows 1,2,4 --kernels qk,i8   (only those)
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from _results import write_results  # type: ignore[import-not-found]  # run from benchmarks/
from _timing import interleaved, one_round  # type: ignore[import-not-found]
from iterserve import kernels
from iterserve.model import quant
from iterserve.model.kquant import KQuantWeight
from iterserve.model.linear import onednn_usable

SHAPES = [(960, 576), (576, 576), (3072, 576), (576, 1536)]  # qkv, o, gate_up, down
HEAD = (49152, 576)
LAYERS = 30
NO_LIMIT = 1 << 20  # max_tile_rows that keeps every row count on the tiled kernel
LAYER_BYTES = {
    "bf16": 2 * LAYERS * sum(n * k for n, k in SHAPES),
    "q4": LAYERS * sum(n * k for n, k in SHAPES) * 5 // 8,  # 4 bits + fp16 d, m per 32
    "i8": LAYERS * sum(n * k for n, k in SHAPES),
}
HEAD_BYTES = {
    "bf16": 2 * HEAD[0] * HEAD[1],
    "q8": HEAD[0] * HEAD[1] * 34 // 32,
    "i8": HEAD[0] * HEAD[1],
}


def interleaved_ms(fns: dict[str, Callable[[], object]], repeats: int) -> dict[str, float]:
    """Median ms per call over `repeats` interleaved rounds, after one to warm up."""
    one_round(fns)
    return {name: seconds * 1e3 for name, seconds in interleaved(fns, repeats).items()}


def random_q4(n: int, k: int) -> quant.QuantizedWeight:
    q = torch.randint(0, 16, (n, k), dtype=torch.uint8)
    d = (torch.rand(n, k // 32) * 0.01).half()
    return quant.QuantizedWeight("q4", q, d, (-torch.rand(n, k // 32) * 0.08).half())


def random_kquant(n: int, k: int, bits: int) -> KQuantWeight:
    zero = 32 if bits == 6 else 0
    weight = KQuantWeight(
        bits, zero, 32,
        torch.randint(0, 1 << bits, (n, k), dtype=torch.uint8),
        # As GGUF has them: a scale per 16 inputs and no minimum at 6 bits (Q6_K), else
        # one scale per 32 and a minimum.
        torch.randint(1, 64, (n, k // (16 if bits == 6 else 32)), dtype=torch.int8).repeat_interleave(
            1 if bits == 6 else 2, dim=1
        ),
        torch.randint(0, 64 if bits < 6 else 1, (n, k // 32), dtype=torch.uint8),
        (torch.rand(n, k // 32) * 1e-3).half(),
        (torch.rand(n, k // 32) * 1e-3).half(),
    )  # fmt: skip
    return weight


QK_BITS = (4, 5, 6)
for _bits in QK_BITS:  # bytes a step reads: the tiles and their super-block scales
    LAYER_BYTES[f"qk{_bits}"] = LAYERS * sum(
        n * k * (256 + 64 * (_bits - 4) + 48) // 512 + n * k // 32 * 4 for n, k in SHAPES
    )


@dataclass
class Weights:
    """Every layer's projections and the head, in each kernel's own layout."""

    dense: list[list[torch.Tensor]]
    dense32: list[list[torch.Tensor]]
    packed: list[list[torch.Tensor]] | None
    tiles: list[list[torch.Tensor]]
    q4: list[list[tuple[torch.Tensor, torch.Tensor]]]
    i8: list[list[tuple[torch.Tensor, torch.Tensor]]]
    qk_int8: dict[int, list[list[tuple[torch.Tensor, torch.Tensor]]]]
    int4pack: list[list[tuple[torch.Tensor, torch.Tensor]]]
    head: torch.Tensor
    head32: torch.Tensor
    head_packed: torch.Tensor | None
    head_tiles: torch.Tensor
    head_q8: tuple[torch.Tensor, torch.Tensor]
    head_i8: tuple[torch.Tensor, torch.Tensor]

    @staticmethod
    def random() -> Weights:
        torch.manual_seed(0)
        dense = [[(torch.randn(n, k) * 0.02).bfloat16() for n, k in SHAPES] for _ in range(LAYERS)]

        def int4pack(n: int, k: int) -> tuple[torch.Tensor, torch.Tensor]:
            q = torch.randint(0, 16, (n, k), dtype=torch.int32)
            packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q, 1)
            return packed, torch.randn(k // 32, n, 2, dtype=torch.bfloat16)

        def i8(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            q, scales = quant.quantize_int8(w)
            return quant.tile_int8(q), scales

        head = (torch.randn(*HEAD) * 0.02).bfloat16()
        bf16_onednn = onednn_usable(torch.bfloat16, torch.device("cpu"))
        q8 = torch.randint(-128, 128, HEAD, dtype=torch.int8)
        kq = {
            bits: [[random_kquant(n, k, bits) for n, k in SHAPES] for _ in range(LAYERS)]
            for bits in QK_BITS
        }
        head_scales = (torch.rand(HEAD[0], HEAD[1] // 32) * 0.01).half()
        return Weights(
            dense=dense,
            dense32=[[w.float() for w in ws] for ws in dense],
            packed=[[torch.ops.mkldnn._reorder_linear_weight(w, None) for w in ws] for ws in dense]
            if bf16_onednn
            else None,
            tiles=[[quant.tile_bf16(w) for w in ws] for ws in dense],
            q4=[[quant.tile_quantized(random_q4(n, k)) for n, k in SHAPES] for _ in range(LAYERS)],
            i8=[[i8(w) for w in ws] for ws in dense],
            qk_int8={bits: [[x.tiles() for x in ws] for ws in kq[bits]] for bits in QK_BITS},
            int4pack=[[int4pack(n, k) for n, k in SHAPES] for _ in range(LAYERS)],
            head=head,
            head32=head.float(),
            head_packed=torch.ops.mkldnn._reorder_linear_weight(head, None)
            if bf16_onednn
            else None,
            head_tiles=quant.tile_bf16(head),
            head_q8=quant.tile_quantized(quant.QuantizedWeight("q8", q8, head_scales, None)),
            head_i8=i8(head),
        )


def measure(
    rows: int, w: Weights, repeats: int, only: list[str] | None = None
) -> list[dict[str, float | int | str]]:
    """One row count through every kernel: layer and head timings in ms."""
    op = kernels.ops().tiled_linear.default

    def tiled(
        x: torch.Tensor, tiles: torch.Tensor, scales: torch.Tensor | None, fmt: int
    ) -> object:
        return op(x, tiles, scales, None, None, fmt, None, None, 0, NO_LIMIT)

    onednn = torch.ops.mkldnn._linear_pointwise
    xs = [torch.randn(rows, k, dtype=torch.bfloat16) for _, k in SHAPES]
    xh = torch.randn(rows, HEAD[1], dtype=torch.bfloat16)
    xs32, xh32 = [x.float() for x in xs], xh.float()

    def layers(call: Callable[[torch.Tensor, int, int], object]) -> Callable[[], None]:
        def run() -> None:
            for layer in range(LAYERS):
                for j, x in enumerate(xs):
                    call(x, layer, j)

        return run

    if rows == 1:  # what a one-row step used before: the matrix-vector kernel
        torch_layers = layers(lambda x, i, j: torch.mv(w.dense[i][j], x[0]))
        torch_head: Callable[[], object] = lambda: torch.mv(w.head, xh[0])  # noqa: E731
    else:
        torch_layers = layers(lambda x, i, j: F.linear(x, w.dense[i][j]))
        torch_head = lambda: F.linear(xh, w.head)  # noqa: E731
    layer_fns: dict[str, Callable[[], object]] = {
        "torch": torch_layers,
        "torch-fp32": layers(lambda x, i, j: F.linear(xs32[j], w.dense32[i][j])),
        "onednn": layers(lambda x, i, j: onednn(x, w.packed[i][j], None, "none", [], "")),
        "tiled-bf16": layers(lambda x, i, j: tiled(x, w.tiles[i][j], None, 0)),
        "tiled-q4": layers(lambda x, i, j: tiled(x, *w.q4[i][j], 1)),
        "tiled-i8": layers(lambda x, i, j: tiled(x, *w.i8[i][j], 3)),
        **{
            f"tiled-qk{bits}-int8": layers(
                lambda x, i, j, b=bits: tiled(
                    x, *w.qk_int8[b][i][j], 5 + 256 * (32 if b == 6 else 0)
                )
            )
            for bits in QK_BITS
        },
        "int4pack": layers(
            lambda x, i, j: torch.ops.aten._weight_int4pack_mm_for_cpu(
                x, w.int4pack[i][j][0], 32, w.int4pack[i][j][1]
            )
        ),
    }
    head_fns: dict[str, Callable[[], object]] = {
        "torch": torch_head,
        "torch-fp32": lambda: F.linear(xh32, w.head32),
        "onednn": lambda: onednn(xh, w.head_packed, None, "none", [], ""),
        "tiled-bf16": lambda: tiled(xh, w.head_tiles, None, 0),
        "tiled-q8": lambda: tiled(xh, *w.head_q8, 2),
        "tiled-i8": lambda: tiled(xh, *w.head_i8, 3),
    }
    if w.packed is None:  # no bf16 oneDNN on this CPU
        del layer_fns["onednn"], head_fns["onednn"]
    if only:
        layer_fns = {k: f for k, f in layer_fns.items() if any(o in k for o in only)}
        head_fns = {k: f for k, f in head_fns.items() if any(o in k for o in only)}
    layer_ms = interleaved_ms(layer_fns, repeats)
    head_ms = interleaved_ms(head_fns, repeats * 4)
    results: list[dict[str, float | int | str]] = []
    for name in dict.fromkeys([*layer_fns, *head_fns]):
        fmt = {"tiled-q4": "q4", "int4pack": "q4", "tiled-q8": "q8", "tiled-i8": "i8"}.get(
            name,
            name.removeprefix("tiled-").removesuffix("-int8")
            if name.startswith("tiled-qk")
            else "bf16",
        )
        lm, hm = layer_ms.get(name), head_ms.get(name)
        if rows >= 512:  # compute-bound: the arithmetic rate says more than bytes
            lbw = f"{2 * rows * LAYER_BYTES['i8'] / lm / 1e6:6.0f}" if lm else ""
            hbw = f"{2 * rows * HEAD_BYTES['i8'] / hm / 1e6:6.0f}" if hm else ""
        else:
            lbw = f"{LAYER_BYTES[fmt] / lm / 1e6:6.1f}" if lm and fmt in LAYER_BYTES else ""
            hbw = f"{HEAD_BYTES[fmt] / hm / 1e6:6.1f}" if hm and fmt in HEAD_BYTES else ""
        lms = f"{lm:10.2f}" if lm else ""
        hms = f"{hm:8.2f}" if hm else ""
        print(f"{rows:4d}  {name:12s} {lms:>10s} {lbw:>6s}   {hms:>8s} {hbw:>6s}", flush=True)
        results.append({"rows": rows, "kernel": name, "layers_ms": lm or 0.0, "head_ms": hm or 0.0})
    return results


def crossover(
    results: list[dict[str, float | int | str]], kernel: str, rival: str, key: str
) -> int:
    """Largest row count at which `kernel` beats `rival` on `key`."""
    theirs = {r["rows"]: r[key] for r in results if r["kernel"] == rival}
    wins = [
        int(r["rows"])
        for r in results
        if r["kernel"] == kernel
        and r[key]
        and r["rows"] in theirs
        and float(r[key]) < float(theirs[r["rows"]])
    ]
    return max(wins, default=0)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", default="1,2,4,8,16,32,64")
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--json", default="bench_results/linear_kernels.json")
    parser.add_argument("--kernels", default="", help="only kernels whose name has one of these")
    args = parser.parse_args()
    if not kernels.available():
        raise SystemExit(f"C++ kernels unavailable: {kernels.why_unavailable()}")
    print(f"kernels: {kernels.isa()} (CPU runs {', '.join(kernels.runnable_isas())})")
    weights = Weights.random()
    print(
        f"{'rows':>4s}  {'kernel':12s} {'layers ms':>10s} {'GB/s':>6s}   {'head ms':>8s} {'GB/s':>6s}"
    )
    results: list[dict[str, float | int | str]] = []
    for rows in [int(r) for r in args.rows.split(",")]:
        only = [k for k in args.kernels.split(",") if k] or None
        results.extend(measure(rows, weights, args.repeats, only))
    print("largest row count at which a kernel beats its rival:")
    rival_of_bf16 = "onednn" if weights.packed is not None else "torch-fp32"
    for kernel, rival, key in (
        ("tiled-bf16", rival_of_bf16, "layers_ms"),
        ("tiled-bf16", rival_of_bf16, "head_ms"),
        ("tiled-q4", "tiled-i8", "layers_ms"),
        ("tiled-q8", "tiled-i8", "head_ms"),
        ("tiled-i8", "tiled-bf16", "layers_ms"),
        *((f"tiled-qk{b}-int8", "tiled-i8", "layers_ms") for b in QK_BITS),
    ):
        where = "layers" if key == "layers_ms" else "head"
        print(f"  {kernel} vs {rival} ({where}): {crossover(results, kernel, rival, key)}")
    write_results(args.json, results)


if __name__ == "__main__":
    main()
