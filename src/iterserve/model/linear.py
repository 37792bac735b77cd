"""A projection's weights in the form its kernels read, and the kernel each step takes.

    y = x @ W.T (+ bias) (+ residual)

Backends, chosen once when the model is built:

- ``torch``: F.linear / addmm on the plain weight. The reference path: exact against
  transformers, and what runs on GPUs, in fp32, and wherever nothing faster is available.
- ``onednn``: oneDNN's GEMM on weights packed once at load (CPU, bf16), for CPUs where
  iterserve's kernels do not run. About 2x torch at every batch size, because torch re-lays
  the weight out on every call (benchmarks/linear_kernels.py).
- ``tiled``: iterserve's C++ kernel (kernels/csrc/linear.cpp). At a few rows it streams the
  weights once per step near memory bandwidth, in bf16 or kept in the checkpoint's 4- or
  8-bit blocks; at hundreds of rows it runs at the bf16 peak, level with oneDNN. Its
  ``i8`` format (W8A8: int8 weights per output row, activations quantized per block of 32
  as they come) doubles that peak with integer dot products.

The residual add rides inside the product in every backend (one op, one rounding).
"""

from __future__ import annotations

from typing import Any, Literal

import torch
import torch.nn.functional as F

from iterserve import kernels
from iterserve.model.kquant import BlockWeight, KQuantWeight
from iterserve.model.quant import (
    BLOCK,
    TILE,
    quantize_int8,
    tile_bf16,
    tile_int8,
    tile_quantized,
)

Backend = Literal["torch", "onednn", "tiled"]
DenseFormat = Literal["bf16", "i8"]  # what the tiled kernel makes of a dense weight

_FORMAT_CODES = {"bf16": 0, "q4": 1, "q8": 2, "i8": 3, "qk-int8": 5}

_NO_LIMIT = 1 << 62

# Rows up to which a checkpoint's 4/8-bit blocks run rather than their dense copy, by whether
# the kernels' ISA variant has bf16 dot products (benchmarks/linear_kernels.py).
# With them (AVX-512 BF16) the 4-bit layers multiply exactly in bf16 and beat the int8 copy
# up to 4 rows (3.6 vs 4.3 ms a step at 1 row, 4.9 vs 5.0 at 4, 7.2 vs 6.2 at 8;
# decode_speed.py: batch 16 656 vs 796 tok/s). Without them (AVX2, NEON) the 4-bit layers
# run on int8 activations, as the int8 copy does, with fewer bytes and no sign handling: they
# beat it at every row count measured (1-64 rows, ITERSERVE_ISA=avx2), so no copy is made.
# The 8-bit head is slower than its int8 copy at every size everywhere (AVX-512 BF16: 1.1 vs
# 0.9 ms at 1 row; AVX2: 1.1 vs 0.9) but exact to the checkpoint, with no activation
# rounding, where greedy decoding picks its tokens: kept for the few-row steps, the 0.2 ms
# knowingly paid.
# The K-quant / 5-bit blocks (qk) run on int8 activations everywhere ("qk-int8", as q4 does
# without bf16 dot products): on AVX-512 BF16 that beat an exact bf16 form of the same
# blocks at 1, 2 and 4 rows and every width (qk_rows.py, 2026-11-26: qk4 260 / 285 / 422 us,
# qk5 336 / 460 / 460, qk6 384 / 459 / 536; removed since), and unpacked to fp32 (AVX2,
# NEON) the exact form lost even to the int8 copy. Against the int8 copy (benchmarks/qk_rows.py: 30
# layers' projections, one thread, us a layer at 1 / 2 / 4 rows) 4-bit blocks win on both
# ISAs (AVX-512 BF16 204 / 230 / 291 vs 227 / 242 / 327; AVX2 163 / 189 / 258 vs 183 / 203 /
# 301), but building 5- and 6-bit bytes costs more than the bytes saved (one row: AVX-512
# BF16 259 / 275 vs 227; AVX2 217 / 213 vs 183), and a Q4_K_M of the bundled model (mostly
# Q5_0) decoded one sequence at 78 tok/s from its blocks against 90 from the int8 copy (one
# thread, benchmarks/kquant_decode.py): so `--weights auto` keeps the int8 copy alone for 5
# and 6 bits, and `int4` the blocks alone (least memory).
MAX_QUANTIZED_ROWS = {
    True: {"q4": 4, "q8": 4, "qk4": 4, "qk5": 0, "qk6": 0},  # native bf16
    False: {"q4": _NO_LIMIT, "q8": 4, "qk4": 4, "qk5": 0, "qk6": 0},
}

# The kernel format each kind of checkpoint block runs as.
KERNEL_FORMATS = {"q4": "q4", "q8": "q8", "qk": "qk-int8"}


def max_quantized_rows(quantized: BlockWeight) -> int:
    """Rows up to which these blocks run rather than a dense copy, on this kernel variant."""
    variant = kernels.describe()
    key = f"qk{quantized.bits}" if isinstance(quantized, KQuantWeight) else quantized.kind
    return MAX_QUANTIZED_ROWS[variant is not None and variant.native_bf16][key]


def _onednn(
    x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None, residual: torch.Tensor | None
) -> torch.Tensor:
    if residual is None:
        return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")
    return torch.ops.mkldnn._linear_pointwise.binary(x, residual, packed, bias, "add")


@torch.library.custom_op("iterserve::onednn_linear", mutates_args=())
def onednn_linear(
    x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None, residual: torch.Tensor | None
) -> torch.Tensor:
    """The oneDNN call as one opaque op for compiled graphs: inductor's own lowering of these
    mkldnn ops expects weights it froze itself, and the fused-add form has no shape function."""
    return _onednn(x, packed, bias, residual)


@onednn_linear.register_fake
def _(
    x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None, residual: torch.Tensor | None
) -> torch.Tensor:
    return x.new_empty((x.shape[0], packed.shape[0]))


def onednn_usable(dtype: torch.dtype, device: torch.device) -> bool:
    """oneDNN packed GEMM runs here: CPU, bf16, and a CPU oneDNN does bf16 on."""
    return (
        device.type == "cpu"
        and dtype == torch.bfloat16
        and torch.backends.mkldnn.is_available()
        and torch.ops.mkldnn._is_mkldnn_bf16_supported()
    )


class Linear:
    """One projection; call it with [M, K] activations (rows may be strided)."""

    def __init__(
        self,
        weight: torch.Tensor,
        bias: torch.Tensor | None = None,
        backend: Backend = "torch",
        quantized: BlockWeight | None = None,
        wide: bool = True,
        dense_format: DenseFormat = "bf16",
    ) -> None:
        """`weight` is the dense [N, K] matrix in the model dtype, which the tiled backend
        keeps in `dense_format`. `quantized`, when given, is the same matrix in its
        checkpoint blocks: the tiled backend then keeps it so for few-row steps, plus
        (`wide`) the dense copy for the others, or alone if not `wide`."""
        self.out_features, self.in_features = weight.shape
        self.bias = bias
        self.backend: Backend = backend
        self.format = "dense"
        self.weight: torch.Tensor | None = None  # torch backend
        self.packed: torch.Tensor | None = None  # onednn backend
        self.tiles: torch.Tensor | None = None  # tiled backend
        self.scales: torch.Tensor | None = None
        self.wide_format = "bf16"
        self.wide: torch.Tensor | None = None  # dense tiles for steps past max_tile_rows
        self.wide_scales: torch.Tensor | None = None
        self.max_tile_rows = _NO_LIMIT
        self.qk_zero = 0  # the qk format's zero point, carried in its format code
        self.ops: Any = None  # the kernels' ops (tiled backend), of the ISA variant chosen
        if quantized is not None and wide and max_quantized_rows(quantized) == 0:
            quantized = None  # the dense copy is faster at every step size: keep it alone
        if backend == "tiled" and not self._tileable(quantized, dense_format):
            backend = self.backend = (
                "onednn" if onednn_usable(weight.dtype, weight.device) else "torch"
            )
        if backend == "tiled":
            self.ops = kernels.ops()
        if backend == "torch":
            self.weight = weight
        elif backend == "onednn":
            self.packed = torch.ops.mkldnn._reorder_linear_weight(weight, None)
        elif quantized is None:
            self.format = dense_format
            self.tiles, self.scales = _tile_dense(weight, dense_format)
        else:
            self.format = KERNEL_FORMATS[quantized.kind]
            if isinstance(quantized, KQuantWeight):
                self.qk_zero = quantized.zero
                self.tiles, self.scales = quantized.tiles()
            else:
                self.tiles, self.scales = tile_quantized(quantized)
            limit = max_quantized_rows(quantized)
            if wide and limit < _NO_LIMIT:
                self.wide_format = dense_format
                self.wide, self.wide_scales = _tile_dense(weight, dense_format)
                self.max_tile_rows = limit

    @property
    def format_codes(self) -> tuple[int, int]:
        """The tiles' format and the wide copy's, as csrc/linear.cpp numbers them."""
        return _FORMAT_CODES[self.format] + 256 * self.qk_zero, _FORMAT_CODES[self.wide_format]

    @property
    def kernel_tensors(self) -> tuple[torch.Tensor | None, ...]:
        """The tiled kernel's tensor arguments: tiles, scales, bias, wide copy, its scales."""
        return (self.tiles, self.scales, self.bias, self.wide, self.wide_scales)

    def _tileable(self, quantized: BlockWeight | None, dense_format: DenseFormat) -> bool:
        if self.out_features % TILE:
            return False
        if quantized is not None or dense_format == "i8":
            return self.in_features % BLOCK == 0
        return self.in_features % 2 == 0

    def __call__(
        self, x: torch.Tensor, residual: torch.Tensor | None = None, fp32_out: bool = False
    ) -> torch.Tensor:
        """`fp32_out`: the tiled kernel may skip rounding the result (others round anyway)."""
        if self.backend == "tiled":
            code, wide_code = self.format_codes
            return self.ops.tiled_linear(
                x,
                self.tiles,
                self.scales,
                self.bias,
                residual,
                code,
                self.wide,
                self.wide_scales,
                wide_code,
                self.max_tile_rows,
                fp32_out,
            )
        if self.backend == "onednn":
            assert self.packed is not None
            if torch.compiler.is_compiling():
                return onednn_linear(x, self.packed, self.bias, residual)
            return _onednn(x, self.packed, self.bias, residual)
        assert self.weight is not None
        if residual is None:
            return F.linear(x, self.weight, self.bias)
        if self.bias is not None:
            residual = residual + self.bias
        return torch.addmm(residual, x, self.weight.t())

    def held_formats(self) -> list[str]:
        """The formats this projection's weights are held and run in (tiled backend)."""
        if self.backend != "tiled":
            return []
        return [self.format] + ([self.wide_format] if self.wide is not None else [])

    def describe(self) -> str:
        if self.backend != "tiled":
            return self.backend
        if self.wide is not None:
            return f"tiled-{self.format}(<={self.max_tile_rows} rows, {self.wide_format} above)"
        return f"tiled-{self.format}"


def _tile_dense(
    weight: torch.Tensor, dense_format: DenseFormat
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """A dense weight in the tiled kernel's layout: bf16 as it is, or int8 with its scales."""
    if dense_format == "bf16":
        return tile_bf16(weight), None
    q, scales = quantize_int8(weight)
    return tile_int8(q), scales
