"""Quantized weights as GGUF stores them, and the tile layouts the C++ linear kernels read.

GGUF's legacy block formats keep 32 inputs of one output row per block:

    Q4_0  18 bytes: fp16 d, 16 bytes of nibbles        w = d * (q - 8)
    Q4_1  20 bytes: fp16 d, fp16 m, 16 bytes of nibbles  w = d * q + m
    Q8_0  34 bytes: fp16 d, 32 int8                     w = d * q

(nibble byte j holds input j in its low half and input j + 16 in its high half). We keep
them quantized as (q, d, m) with one layout for both 4-bit kinds (Q4_0's m is -8d, exact in
fp16), and repack them for the kernels: see csrc/linear.cpp for the tile layouts.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

TILE = 16
BLOCK = 32

BLOCK_BYTES = {"Q4_0": 18, "Q4_1": 20, "Q8_0": 34}


@dataclass(frozen=True)
class QuantizedWeight:
    """One [N, K] weight matrix in a GGUF block format, unpacked per element.

    q: [N, K] uint8 (0..15) for the 4-bit kinds, int8 for Q8_0; d, m: [N, K/32] fp16
    (m is None for Q8_0).
    """

    kind: str  # "q4" or "q8"
    q: torch.Tensor
    d: torch.Tensor
    m: torch.Tensor | None

    @property
    def shape(self) -> tuple[int, int]:
        return (self.q.shape[0], self.q.shape[1])

    @property
    def layout(self) -> tuple[str]:
        """What must agree for two matrices to be stacked into one (fused q/k/v)."""
        return (self.kind,)

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The exact weights in fp32 (then cast): what every kernel must agree with."""
        n, k = self.shape
        q = self.q.view(n, k // BLOCK, BLOCK).float()
        w = q * self.d.float()[..., None]
        if self.m is not None:
            w = w + self.m.float()[..., None]
        return w.view(n, k).to(dtype)

    def rows(self, index: torch.Tensor) -> QuantizedWeight:
        """A row permutation or selection (rope un-permuting, fusing q/k/v keeps rows whole)."""
        return QuantizedWeight(
            self.kind,
            self.q[index],
            self.d[index],
            None if self.m is None else self.m[index],
        )

    @staticmethod
    def cat(parts: list[QuantizedWeight]) -> QuantizedWeight:
        kinds = {p.kind for p in parts}
        if len(kinds) != 1:
            raise ValueError(f"cannot fuse weights of different formats {sorted(kinds)}")
        has_m = parts[0].m is not None
        return QuantizedWeight(
            parts[0].kind,
            torch.cat([p.q for p in parts]),
            torch.cat([p.d for p in parts]),
            torch.cat([p.m for p in parts]) if has_m else None,  # type: ignore[misc]
        )


def from_gguf_blocks(raw: np.ndarray, qtype: str, shape: tuple[int, int]) -> QuantizedWeight:
    """GGUF bytes of an [N, K] tensor in Q4_0, Q4_1 or Q8_0 -> QuantizedWeight."""
    n, k = shape
    if k % BLOCK:
        raise ValueError(f"{qtype} rows of {k} inputs are not whole blocks of {BLOCK}")
    # A copy: the bytes usually come straight from a read-only mmap of the file.
    blocks = torch.from_numpy(np.array(raw).reshape(n, k // BLOCK, BLOCK_BYTES[qtype]))
    d = blocks[..., 0:2].contiguous().view(torch.float16).squeeze(-1)
    if qtype == "Q8_0":
        q = blocks[..., 2:].contiguous().view(torch.int8).reshape(n, k)
        return QuantizedWeight("q8", q, d, None)
    if qtype == "Q4_1":
        m = blocks[..., 2:4].contiguous().view(torch.float16).squeeze(-1)
        nibbles = blocks[..., 4:]
    elif qtype == "Q4_0":
        m = -8 * d
        nibbles = blocks[..., 2:]
    else:
        raise ValueError(f"no quantized kernel for {qtype}")
    q = torch.cat((nibbles & 0x0F, nibbles >> 4), dim=-1).reshape(n, k)
    return QuantizedWeight("q4", q, d, m)


# ---- tile layouts for csrc/linear.cpp ---------------------------------------------------


def tile_bf16(weight: torch.Tensor) -> torch.Tensor:
    """[N, K] bf16 -> [N/16, K/2, 16, 2]: 16 outputs' weights for each pair of inputs."""
    n, k = weight.shape
    return weight.reshape(n // TILE, TILE, k // 2, 2).permute(0, 2, 1, 3).contiguous()


def tile_quantized(weight: QuantizedWeight) -> tuple[torch.Tensor, torch.Tensor]:
    """QuantizedWeight -> (tiled q bytes, tiled fp16 scales) for the q4 / q8 kernels."""
    n, k = weight.shape
    tiles, blocks = n // TILE, k // BLOCK
    # [tiles, blocks, pair, lane, even/odd]
    q = weight.q.reshape(tiles, TILE, blocks, BLOCK // 2, 2).permute(0, 2, 3, 1, 4)

    def per_tile(s: torch.Tensor) -> torch.Tensor:  # [N, blocks] -> [tiles, blocks, 16]
        return s.reshape(tiles, TILE, blocks).transpose(1, 2)

    if weight.kind == "q8":
        return q.reshape(tiles, blocks, 512).contiguous(), per_tile(weight.d).contiguous()
    assert weight.m is not None
    scales = torch.stack((per_tile(weight.d), per_tile(weight.m)), dim=2)
    return pack_nibble_tiles(weight.q), scales.contiguous()


def pack_nibble_tiles(q: torch.Tensor) -> torch.Tensor:
    """[N, K] uint8 in 0..15 -> [N/16, K/32, 256]: the q4 tiles' nibbles (also the low bits of
    the K-quant tiles, model/kquant.py)."""
    n, k = q.shape
    tiles, blocks = n // TILE, k // BLOCK
    # [tiles, blocks, pair, lane, even/odd]
    q = q.reshape(tiles, TILE, blocks, BLOCK // 2, 2).permute(0, 2, 3, 1, 4)
    # Chunk c of a block packs pairs 4c..4c+3 into 16-bit words: pair 4c+i in bits 4i..4i+3.
    pairs = q.reshape(tiles, blocks, 4, 4, 2 * TILE).to(torch.int16)
    words = pairs[:, :, :, 0] | pairs[:, :, :, 1] << 4 | pairs[:, :, :, 2] << 8
    words = words | pairs[:, :, :, 3] << 12
    return words.contiguous().view(torch.uint8).reshape(tiles, blocks, 256).contiguous()


def quantize_int8(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[N, K] float -> (q [N, K] int8 in -127..127, s [N] fp32) with weight ~ s * q: one
    symmetric scale per output row, the weight half of W8A8."""
    w = weight.float()
    scales = w.abs().amax(dim=1) / 127.0
    inv = torch.where(scales > 0, 1.0 / scales, torch.zeros_like(scales))
    q = torch.round(w * inv[:, None]).clamp(-127, 127).to(torch.int8)
    return q, scales


def quantize_activations(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[M, K] -> (q [M, K] int8, s [M, K/32] fp32) with x ~ s * q per block of 32 inputs:
    the activation half of W8A8, rounded exactly as csrc/linear.cpp rounds it."""
    m, k = x.shape
    blocks = x.float().reshape(m, k // BLOCK, BLOCK)
    amax = blocks.abs().amax(dim=-1)
    # A true division (`127.0 / amax` would multiply by a rounded reciprocal).
    inv = torch.where(amax > 0, torch.full_like(amax, 127.0) / amax, torch.zeros_like(amax))
    q = torch.round(blocks * inv[..., None]).to(torch.int8).reshape(m, k)
    return q, amax / 127.0


def tile_int8(q: torch.Tensor) -> torch.Tensor:
    """[N, K] int8 -> [N/16, K/4, 16, 4] uint8 (q + 128): 16 outputs' weights for each four
    inputs, unsigned as `vpdpbusd` takes its first operand."""
    n, k = q.shape
    biased = (q.to(torch.int16) + 128).to(torch.uint8)
    return biased.reshape(n // TILE, TILE, k // 4, 4).permute(0, 2, 1, 3).contiguous()
