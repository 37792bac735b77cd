"""The weight formats the C++ kernels run, one codec a GGUF type (as llama.cpp's type traits):

- its block layout in the file (`inputs` a block, `file_bytes` a block), read as the file
  stores it (`GGUFBlocks` in model/gguf_blocks.py);
- its reference dequantizer: the `gguf` package's, which the kernels are tested against
  (tests/kernels/test_block_formats.py);
- its kernel layout and dot product: tiles of 16 output rows (csrc/blocks.h), made from the
  file's bytes in one pass (`repack`, csrc/repack.cpp) and multiplied in them at every step
  size (csrc/linear.cpp), `tile_bytes` for 16 rows of one block;
- the activation format it pairs with: the activations quantized to int8 with one scale per
  unit of the format's inputs (`inputs`: 32, or 256 for the K-quants), as llama.cpp's q8_0
  and q8_K are (`quantize_activations`). A K-quant's per-block scales then fold into one sum
  per unit before the activations' scale: half the fp32 work a Q6_K block took with a scale
  per 32 inputs (csrc/tiles.h).

Dense weights run as bf16 (or fp16 for fp16 checkpoints) tiles: pairs of inputs of 16 outputs
side by side.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from iterserve.model.host_memory import weight_buffer

TILE = 16  # output rows a tile


@dataclass(frozen=True)
class BlockFormat:
    name: str  # the GGUF type
    code: int  # csrc/blocks.h's Format
    inputs: int  # inputs a block (32, or 256 for the K-quants)
    file_bytes: int  # GGUF bytes a block of one row
    tile_bytes: int  # kernel bytes a block of 16 rows

    def row_bytes(self, k: int) -> int:
        """File bytes of one row of k inputs."""
        return k // self.inputs * self.file_bytes

    def bytes_per_tile(self, k: int) -> int:
        return k // self.inputs * self.tile_bytes

    @property
    def activation_unit(self) -> int:
        """Inputs that share one activation scale: the format's own unit."""
        return self.inputs

    @property
    def bits_per_weight(self) -> float:
        return 8 * self.tile_bytes / (TILE * self.inputs)


# Dense formats' codes (csrc/blocks.h).
BF16, F16 = 0, 1

BLOCK_FORMATS: dict[str, BlockFormat] = {
    f.name: f
    for f in (
        BlockFormat("Q4_0", 10, 32, 18, 288),
        BlockFormat("Q4_1", 11, 32, 20, 320),
        BlockFormat("Q5_0", 12, 32, 22, 352),
        BlockFormat("Q5_1", 13, 32, 24, 384),
        BlockFormat("Q8_0", 14, 32, 34, 544),
        BlockFormat("IQ4_NL", 15, 32, 18, 288),
        BlockFormat("MXFP4", 16, 32, 17, 288),
        BlockFormat("Q2_K", 20, 256, 84, 1344),
        BlockFormat("Q3_K", 21, 256, 110, 1856),
        BlockFormat("Q4_K", 22, 256, 144, 2368),
        BlockFormat("Q5_K", 23, 256, 176, 2880),
        BlockFormat("Q6_K", 24, 256, 210, 3392),
        BlockFormat("IQ4_XS", 25, 256, 136, 2240),
    )
}
FORMAT_NAMES = {f.code: f.name for f in BLOCK_FORMATS.values()} | {BF16: "bf16", F16: "f16"}


def padded_rows(n: int) -> int:
    return -(-n // TILE) * TILE


def repack(
    ops: object,
    raw: np.ndarray,
    fmt: BlockFormat,
    k: int,
    rows: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
    first_tile: int = 0,
) -> torch.Tensor:
    """A tensor's file bytes ([n, row_bytes] uint8) -> its tiles ([tiles, bytes] uint8),
    written into `out` from `first_tile` on (a new tensor if None). `rows`: the source row of
    each output row (a permutation, or -1 for a zero row); default every row, padded with zero
    rows to a multiple of 16."""
    source = torch.from_numpy(raw)
    count = rows.numel() if rows is not None else padded_rows(raw.shape[0])
    if out is None:
        out = weight_buffer(count // TILE, fmt.bytes_per_tile(k))
    ops.repack_gguf(source, fmt.code, k, rows, out, first_tile)  # type: ignore[attr-defined]
    return out


def tile_dense(weight: torch.Tensor) -> tuple[torch.Tensor, int]:
    """A dense [N, K] weight -> (tiles [N/16 padded, bytes] uint8, format code): fp16 stays
    fp16 ([K/2, 2, 16] a tile, a pair's inputs for 16 outputs apart), anything else bf16
    ([K/2, 16, 2]: each output's two inputs side by side, as `vdpbf16ps` takes them)."""
    n, k = weight.shape
    pad = padded_rows(n) - n
    code = F16 if weight.dtype == torch.float16 else BF16
    w = weight.to(torch.float16 if code == F16 else torch.bfloat16)
    if pad:
        w = torch.cat((w, w.new_zeros(pad, k)))
    tiles = (n + pad) // TILE
    pairs = w.reshape(tiles, TILE, k // 2, 2)
    order = (0, 2, 3, 1) if code == F16 else (0, 2, 1, 3)
    laid = pairs.permute(*order)
    # On huge pages where large, as a block format's tiles (repack).
    out = weight_buffer(tiles, TILE * k * w.element_size())
    out.view(w.dtype).view(laid.shape).copy_(laid)
    return out, code


def quantize_q8_0(weight: torch.Tensor) -> np.ndarray:
    """A dense [N, K] weight as GGUF Q8_0 bytes ([N, K/32 * 34] uint8): `--weights int8`'s
    blocks, made as llama.cpp's quantizer makes them (d = max|w| / 127 per block of 32)."""
    n, k = weight.shape
    blocks = weight.float().reshape(n, k // 32, 32)
    d = blocks.abs().amax(dim=-1) / 127.0
    inv = torch.where(d > 0, 1.0 / d, torch.zeros_like(d))
    q = torch.round(blocks * inv[..., None]).clamp(-127, 127).to(torch.int8)
    raw = torch.cat((d.half()[..., None].view(torch.uint8), q.view(torch.uint8)), dim=-1)
    return raw.reshape(n, -1).numpy()


def quantize_activations(x: torch.Tensor, unit: int = 32) -> tuple[torch.Tensor, torch.Tensor]:
    """[M, K] -> (q [M, K] int8, s [M, K/unit] fp32) with x ~ s * q per unit of inputs (32 or
    256, a format's `activation_unit`): the activations the block formats pair with, rounded
    exactly as csrc/tiles.h rounds them."""
    m, k = x.shape
    blocks = x.float().reshape(m, k // unit, unit)
    amax = blocks.abs().amax(dim=-1)
    # A true division (`127.0 / amax` would multiply by a rounded reciprocal).
    inv = torch.where(amax > 0, torch.full_like(amax, 127.0) / amax, torch.zeros_like(amax))
    q = torch.round(blocks * inv[..., None]).to(torch.int8).reshape(m, k)
    return q, amax / 127.0


def activations_as_quantized(x: torch.Tensor, unit: int = 32) -> torch.Tensor:
    """x as the block formats' kernels see it, s * q (float64): what their results are checked
    against, times the dequantized weights."""
    q, s = quantize_activations(x, unit)
    m, k = x.shape
    return (q.double().view(m, k // unit, unit) * s.double()[..., None]).view(m, k)
