"""A projection's weights in the form its kernels read, built straight from the checkpoint.

    y = x @ W.T (+ bias) (+ residual)

W is one or more checkpoint tensors stacked by rows (`WeightPart`s: a fused q/k/v is three),
turned into the chosen backend's form one part at a time, so a projection is never held
dense unless its backend computes densely:

- ``torch``: F.linear / addmm on the plain weight. The reference path: exact against
  transformers, and what runs on GPUs, in fp32, and wherever nothing faster is available.
- ``onednn``: oneDNN's GEMM on weights packed once at load (CPU, bf16), for CPUs where
  iterserve's kernels do not run. About 2x torch at every batch size, because torch re-lays
  the weight out on every call (benchmarks/linear_kernels.py).
- ``tiled``: iterserve's C++ kernels (kernels/csrc/linear.cpp). Each part becomes one segment
  of tiles in its own format: a GGUF tensor's blocks as the file stores them
  (model/block_formats.py: Q4_K stays Q4_K, its v part Q6_K), run on int8 activations at
  every step size; dense weights as bf16 (fp16 ones as fp16). `mode` "bf16" makes every part
  dense bf16 (exact to the dequantized weights), "int8" makes every part Q8_0 blocks.

The residual add rides inside the product in every backend (one op, one rounding).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Literal

import torch
import torch.nn.functional as F

from iterserve import kernels
from iterserve.model.block_formats import (
    BLOCK_FORMATS,
    FORMAT_NAMES,
    TILE,
    padded_rows,
    quantize_q8_0,
    repack,
    tile_dense,
)
from iterserve.model.gguf_blocks import QuantizedBlocks

Backend = Literal["torch", "onednn", "tiled"]
# How the tiled backend holds weights: "blocks" keeps a checkpoint's quantized blocks (and its
# dense weights 16-bit), "bf16" makes everything dense bf16, "int8" everything Q8_0.
WeightMode = Literal["blocks", "bf16", "int8"]


@dataclass(frozen=True)
class WeightPart:
    """One checkpoint tensor of a projection, not yet read."""

    name: str
    shape: tuple[int, int]
    dense: Callable[[], torch.Tensor]  # its values in the model's dtype
    native: Callable[[], torch.Tensor]  # as the checkpoint stores them (fp16 stays fp16)
    blocks: QuantizedBlocks | None = None  # its quantized blocks, where the file has them


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


def _tileable(parts: Sequence[WeightPart], mode: WeightMode) -> bool:
    """The tiled kernels take these parts: whole tiles between parts (only the last may be
    padded), and rows of whole blocks for the block formats."""
    k = parts[0].shape[1]
    if any(p.shape[0] % TILE for p in parts[:-1]):
        return False
    for part in parts:
        if mode == "int8" or (mode == "blocks" and part.blocks is not None):
            inputs = part.blocks.format.inputs if part.blocks and mode == "blocks" else 32
            if k % inputs:
                return False
        elif k % 2:
            return False
    return True


class Linear:
    """One projection; call it with [M, K] activations (rows may be strided)."""

    def __init__(
        self,
        parts: Sequence[WeightPart],
        bias: torch.Tensor | None = None,
        backend: Backend = "torch",
        mode: WeightMode = "blocks",
        dtype: torch.dtype = torch.bfloat16,
        tiles: Sequence[tuple[torch.Tensor, int]] | None = None,
    ) -> None:
        """`tiles`: each part's tiles and format where they were made already (a layer's
        experts, made straight into one stack a projection: model/moe.py)."""
        self.out_features = sum(p.shape[0] for p in parts)
        self.in_features = parts[0].shape[1]
        self.bias = bias
        self.weight: torch.Tensor | None = None  # torch backend
        self.packed: torch.Tensor | None = None  # onednn backend
        self.segments: list[torch.Tensor] = []  # tiled backend: [tiles, bytes] uint8 each
        self.codes: list[int] = []  # each segment's format (csrc/blocks.h)
        self.ops: Any = None  # the kernels' ops (tiled backend), of the ISA variant chosen
        if backend == "tiled" and not _tileable(parts, mode):
            backend = "onednn" if onednn_usable(dtype, torch.device("cpu")) else "torch"
        self.backend: Backend = backend
        if backend == "tiled":
            self.ops = kernels.ops()
            for i, part in enumerate(parts):
                segment, code = tiles[i] if tiles is not None else self._tiles(part, mode)
                self.segments.append(segment)
                self.codes.append(code)
            padded = padded_rows(self.out_features)
            if bias is not None and padded > self.out_features:
                self.bias = torch.cat((bias, bias.new_zeros(padded - self.out_features)))
            return
        weight = (
            torch.cat([p.dense().to(dtype) for p in parts])
            if len(parts) > 1
            else parts[0].dense().to(dtype)
        )
        if backend == "onednn":
            self.packed = torch.ops.mkldnn._reorder_linear_weight(weight, None)
        else:
            self.weight = weight

    def _tiles(self, part: WeightPart, mode: WeightMode) -> tuple[torch.Tensor, int]:
        if mode == "blocks" and part.blocks is not None:
            return part.blocks.tiles(self.ops), part.blocks.format.code
        if mode == "int8":
            q8 = BLOCK_FORMATS["Q8_0"]
            return repack(self.ops, quantize_q8_0(part.dense()), q8, part.shape[1]), q8.code
        values = part.native() if mode == "blocks" else part.dense()
        return tile_dense(values)

    @property
    def kernel_args(self) -> tuple[list[torch.Tensor], list[int], torch.Tensor | None]:
        """The tiled kernel's weight arguments: segments, their formats, the bias."""
        return self.segments, self.codes, self.bias

    @property
    def nbytes(self) -> int:
        """Bytes of weights this projection holds."""
        held = [*self.segments, self.weight, self.packed]
        return sum(t.numel() * t.element_size() for t in held if t is not None)

    def __call__(
        self, x: torch.Tensor, residual: torch.Tensor | None = None, fp32_out: bool = False
    ) -> torch.Tensor:
        """`fp32_out`: the tiled kernel may skip rounding the result (others round anyway)."""
        if self.backend == "tiled":
            if residual is not None and residual.shape[1] != padded_rows(self.out_features):
                residual = F.pad(residual, (0, padded_rows(self.out_features) - residual.shape[1]))
            out = self.ops.tiled_linear(x, self.segments, self.codes, self.bias, residual, fp32_out)
            return out if out.shape[1] == self.out_features else out[:, : self.out_features]
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
        return [FORMAT_NAMES[c] for c in dict.fromkeys(self.codes)]

    def describe(self) -> str:
        if self.backend != "tiled":
            return self.backend
        return "tiled-" + "+".join(self.held_formats())
