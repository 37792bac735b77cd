"""GGUF's K-quants (Q4_K, Q5_K, Q6_K) and 5-bit blocks (Q5_0, Q5_1) kept quantized.

Every one of these formats is, per weight,

    w = d * sc * (q - z) - dmin * mn

with q unsigned (4, 5 or 6 bits), d and dmin fp16 per super-block (256 inputs for the
K-quants, 32 for Q5_0/Q5_1), sc an integer scale per 16 inputs (6 bits for Q4_K/Q5_K,
signed 8 bits for Q6_K, 1 for Q5_x), mn an integer minimum per 32 inputs (6 bits, or 0 for
Q6_K; Q5_0's -16d is 16 * d) and z the zero point (32 for Q6_K, else 0). `dequantize` computes
it in that order of fp32 operations, which is the `gguf` package's (tests check it bit for bit).

The kernel layout ("qk" in csrc/linear.cpp, run as qk-int8) keeps the 4-bit low parts as the q4 format's
tiles, the 1-2 high bits beside them, the integer scales as bytes and the fp16 super-block
scales apart: 4.9 bits a weight for Q4_K (4.5 in the file), 5.9 for Q5_K, 6.9 for Q6_K.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from iterserve.model.quant import BLOCK, TILE, QuantizedWeight, pack_nibble_tiles

SUPER = 256  # inputs per K-quant super-block (QK_K)
SUB = 16  # inputs per integer scale

# GGUF type -> (bytes per block, inputs per block)
BLOCK_SIZES = {
    "Q4_K": (144, 256),
    "Q5_K": (176, 256),
    "Q6_K": (210, 256),
    "Q5_0": (22, 32),
    "Q5_1": (24, 32),
}


@dataclass(frozen=True)
class KQuantWeight:
    """One [N, K] weight matrix in one of the formats above, unpacked per element.

    q: [N, K] uint8; scales: [N, K/16] int8 (sc); mins: [N, K/32] uint8 (mn);
    d, dmin: [N, K/super] fp16.
    """

    bits: int  # of q: 4, 5 or 6
    zero: int  # z
    super_size: int  # inputs per (d, dmin): 256 or 32
    q: torch.Tensor
    scales: torch.Tensor
    mins: torch.Tensor
    d: torch.Tensor
    dmin: torch.Tensor

    kind = "qk"

    @property
    def shape(self) -> tuple[int, int]:
        return (self.q.shape[0], self.q.shape[1])

    @property
    def layout(self) -> tuple[str, int, int, int]:
        """What must agree for two matrices to be stacked into one (fused q/k/v)."""
        return (self.kind, self.bits, self.zero, self.super_size)

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        n, k = self.shape
        per_sub = self.super_size // SUB
        step = self.d.float().repeat_interleave(per_sub, dim=1) * self.scales.float()
        q = self.q.view(n, k // SUB, SUB).float() - self.zero
        w = (step[..., None] * q).view(n, k // BLOCK, BLOCK)
        low = self.dmin.float().repeat_interleave(self.super_size // BLOCK, dim=1)
        w = w - (low * self.mins.float())[..., None]
        return w.view(n, k).to(dtype)

    def rows(self, index: torch.Tensor) -> KQuantWeight:
        return KQuantWeight(
            self.bits, self.zero, self.super_size, self.q[index], self.scales[index],
            self.mins[index], self.d[index], self.dmin[index],
        )  # fmt: skip

    @staticmethod
    def cat(parts: list[KQuantWeight]) -> KQuantWeight:
        if len({p.layout for p in parts}) != 1:
            raise ValueError(
                f"cannot fuse weights of different formats {[p.layout for p in parts]}"
            )
        first = parts[0]
        return KQuantWeight(
            first.bits, first.zero, first.super_size,
            *(torch.cat([getattr(p, f) for p in parts]) for f in ("q", "scales", "mins", "d", "dmin")),
        )  # fmt: skip

    def tiles(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(bytes [N/16, K/32, 256 + 64 h + 48], fp16 [N/16, K/super, 2, 16]): what the
        qk-int8 kernel reads, per tile of 16 outputs and block of 32 inputs:

            256 bytes   the low 4 bits of q, as the q4 tiles lay them out (see quant.py)
            64 h bytes  the h = bits - 4 high bits, in planes beside the nibble bytes they
                        complete (`_high_planes`)
            32 bytes    sc of inputs 0-15 for the 16 outputs, then of inputs 16-31
            16 bytes    mn for the 16 outputs
        """
        n, k = self.shape
        tiles, blocks = n // TILE, k // BLOCK
        self._check_int8_form()
        parts = [pack_nibble_tiles(self.q & 0x0F)]
        if self.bits > 4:
            parts.append(self._high_planes())
        sc = self.scales.reshape(tiles, TILE, blocks, 2).permute(0, 2, 3, 1)
        parts.append(sc.contiguous().view(torch.uint8).reshape(tiles, blocks, 2 * TILE))
        parts.append(self.mins.reshape(tiles, TILE, blocks).transpose(1, 2))
        supers = k // self.super_size
        scales = torch.stack((self.d, self.dmin), dim=1).reshape(tiles, TILE, 2, supers)
        return torch.cat(parts, dim=2).contiguous(), scales.permute(0, 3, 2, 1).contiguous()

    def _check_int8_form(self) -> None:
        """What the qk-int8 kernel assumes of every GGUF type it takes: 6 bits (Q6_K) have a
        scale per 16 inputs, a zero point and no minimum; fewer bits one scale per 32
        inputs (both of its 16-input scales equal) and no zero point."""
        n, k = self.shape
        if self.bits == 6:
            ok = not bool(self.mins.any())
        else:
            pairs = self.scales.view(n, k // BLOCK, 2)
            ok = self.zero == 0 and torch.equal(pairs[..., 0], pairs[..., 1])
        if not ok:
            raise ValueError(f"{self.bits}-bit blocks of a form no GGUF type has (see qk-int8)")

    def _high_planes(self) -> torch.Tensor:
        """The high bits for the qk-int8 kernel, [N/16, K/32, 64 h]: 64-byte planes parallel to
        a chunk's 64 nibble bytes (lane j's byte t: its low nibble holds input 8c + u, its high
        nibble 8c + u + 2, u = (0, 4, 1, 5)[t]), so that one shift puts them over the nibbles.
        Plane P's byte holds, for chunks c of P, the bits of its low (e = 0) and high (e = 1)
        nibble at h (2 (c mod 4/h) + e)."""
        n, k = self.shape
        tiles, blocks, high_bits = n // TILE, k // BLOCK, self.bits - 4
        per_plane = 4 // high_bits
        # Input within a chunk's 8 of nibble e of byte t.
        inputs = torch.tensor([[0, 4, 1, 5], [2, 6, 3, 7]])
        high = (self.q >> 4).reshape(tiles, TILE, blocks, 4, 8)[..., inputs].to(torch.int32)
        # [tiles, lane, blocks, plane, chunk in plane, e, t]
        high = high.reshape(tiles, TILE, blocks, high_bits, per_plane, 2, 4)
        shifts = high_bits * torch.arange(2 * per_plane, dtype=torch.int32).view(per_plane, 2, 1)
        planes = (high << shifts).sum(dim=(4, 5)).to(torch.uint8)  # [tiles, lane, blocks, P, t]
        return planes.permute(0, 2, 3, 1, 4).reshape(tiles, blocks, 64 * high_bits)


def from_gguf_kquant(raw: np.ndarray, qtype: str, shape: tuple[int, int]) -> KQuantWeight:
    """GGUF bytes of an [N, K] tensor in one of BLOCK_SIZES' types -> KQuantWeight."""
    n, k = shape
    nbytes, size = BLOCK_SIZES[qtype]
    if k % size:
        raise ValueError(f"{qtype} rows of {k} inputs are not whole blocks of {size}")
    blocks = torch.from_numpy(np.array(raw).reshape(n * k // size, nbytes))
    count = blocks.shape[0]
    unpack = {"Q4_K": _q4_k, "Q5_K": _q5_k, "Q6_K": _q6_k, "Q5_0": _q5_x, "Q5_1": _q5_x}[qtype]
    bits, zero, q, scales, mins, d, dmin = unpack(blocks, qtype)
    return KQuantWeight(
        bits, zero, size,
        q.reshape(n, k), scales.reshape(n, k // SUB).to(torch.int8),
        mins.reshape(n, k // BLOCK).to(torch.uint8),
        d.reshape(n, count // n), dmin.reshape(n, count // n),
    )  # fmt: skip


def _fp16(raw: torch.Tensor) -> torch.Tensor:
    return raw.contiguous().view(torch.float16).squeeze(-1)


def _nibbles(qs: torch.Tensor, group: int) -> torch.Tensor:
    """[B, bytes] -> [B, 2 * bytes]: each `group` bytes give their low nibbles, then their high."""
    qs = qs.reshape(qs.shape[0], -1, 1, group)
    return torch.cat((qs & 0x0F, qs >> 4), dim=2).reshape(qs.shape[0], -1)


def _k_scales(packed: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Q4_K/Q5_K's 12 bytes -> 8 six-bit scales and 8 six-bit minimums per super-block."""
    a, b, c = packed[:, 0:4], packed[:, 4:8], packed[:, 8:12]
    sc = torch.cat((a & 0x3F, (c & 0x0F) | ((a >> 2) & 0x30)), dim=1)
    mn = torch.cat((b & 0x3F, (c >> 4) | ((b >> 2) & 0x30)), dim=1)
    return sc, mn


def _q4_k(blocks: torch.Tensor, _: str) -> tuple:
    sc, mn = _k_scales(blocks[:, 4:16])
    q = _nibbles(blocks[:, 16:], 32)
    return 4, 0, q, sc.repeat_interleave(2, dim=1), mn, _fp16(blocks[:, 0:2]), _fp16(blocks[:, 2:4])


def _q5_k(blocks: torch.Tensor, _: str) -> tuple:
    sc, mn = _k_scales(blocks[:, 4:16])
    high = blocks[:, 16:48]  # bit i of byte j: input 32 i + j
    shifts = torch.arange(8, dtype=torch.uint8).view(1, 8, 1)
    q = _nibbles(blocks[:, 48:], 32) | ((high[:, None, :] >> shifts) & 1).reshape(-1, 256) << 4
    return 5, 0, q, sc.repeat_interleave(2, dim=1), mn, _fp16(blocks[:, 0:2]), _fp16(blocks[:, 2:4])


def _q6_k(blocks: torch.Tensor, _: str) -> tuple:
    low = _nibbles(blocks[:, :128], 64)
    # 2 bits of input 128 h + 32 s + j at bits 2 s of byte 32 h + j
    high = blocks[:, 128:192].reshape(-1, 2, 1, 32)
    shifts = torch.tensor([0, 2, 4, 6], dtype=torch.uint8).view(1, 1, 4, 1)
    q = low | ((high >> shifts) & 3).reshape(-1, 256) << 4
    sc = blocks[:, 192:208].view(torch.int8)
    d = _fp16(blocks[:, 208:210])
    count = blocks.shape[0]
    return 6, 32, q, sc, torch.zeros(count, 8, dtype=torch.uint8), d, torch.zeros_like(d)


def _q5_x(blocks: torch.Tensor, qtype: str) -> tuple:
    d = _fp16(blocks[:, 0:2])
    if qtype == "Q5_1":  # w = d q + m: dmin = -m, mn = 1
        dmin, rest, mn = -_fp16(blocks[:, 2:4]), blocks[:, 4:], 1
    else:  # w = d (q - 16) = d q - 16 d: dmin = d, mn = 16 (both products exact)
        dmin, rest, mn = d, blocks[:, 2:], 16
    high = rest[:, 0:4].contiguous().view(torch.int32)  # bit i: input i
    shifts = torch.arange(32, dtype=torch.int32).view(1, 32)
    q = _nibbles(rest[:, 4:], 16) | (((high >> shifts) & 1).to(torch.uint8) << 4)
    count = blocks.shape[0]
    ones = torch.ones(count, 2, dtype=torch.uint8)
    return 5, 0, q, ones, torch.full((count, 1), mn, dtype=torch.uint8), d, dmin


# A weight kept in its checkpoint's blocks, in either family of formats.
BlockWeight = QuantizedWeight | KQuantWeight
