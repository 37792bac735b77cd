"""Rotary position embeddings: every RoPE variant iterserve runs, as one table per model.

A variant is a rule for the rotation frequencies of each position. The model never computes
them per step: `rope_tables` builds cos and (sign-folded) sin for every position once, and a
step indexes rows by position, in torch or in the C++ layer op alike. That also settles the
two variants whose frequencies transformers changes with the sequence length:

- ``longrope`` (Phi-3/3.5): transformers uses the short factors for a whole forward whose
  longest position is inside ``original_max_position_embeddings`` and the long factors for
  all of it otherwise. iterserve rotates position p with the long factors iff
  p >= original_max_position_embeddings. That is exactly what transformers computes when it
  generates token by token past the original context (each new token's forward is "long",
  the cached keys keep the rotation they had), and exactly a single forward's result while the
  sequence fits the original context; a single transformers forward over a longer prompt
  rotates its early positions with the long factors instead.
- ``dynamic`` (NTK): the base grows with the sequence length L = max(p + 1, original); iterserve
  freezes position p at L = p + 1, again transformers' token-by-token result.

A model may rotate only the first `rotary_dim` dimensions of each head (HF's
``partial_rotary_factor``, GGUF's ``rope.dimension_count``: Phi-4-mini rotates 96 of 128): the
tables are then `rotary_dim` wide, every variant's frequencies are those of a head that wide
(as transformers computes them), and the rest of the head passes through unscaled.

Every variant is checked against transformers' own rotary embedding and model past the
original context (tests/model/test_rope.py).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import torch

# rope_type values (HF's spelling) iterserve runs. "freq_factors" is llama.cpp's form of
# Llama 3 scaling: a GGUF stores the per-frequency divisors as the `rope_freqs` tensor.
SUPPORTED_ROPE_TYPES = (
    "default",
    "linear",
    "llama3",
    "yarn",
    "longrope",
    "dynamic",
    "freq_factors",
    "proportional",
)
# Variants whose rotation changes with the position beyond the original context.
_POSITION_DEPENDENT = ("longrope", "dynamic")


class UnsupportedRope(ValueError):
    """A rope configuration iterserve does not run; the message names it."""


def rope_type_of(scaling: Mapping[str, Any] | None) -> str:
    scaling = scaling or {}
    return str(scaling.get("rope_type", scaling.get("type", "default")))


def check_rope_scaling(scaling: Mapping[str, Any] | None) -> None:
    """Refuse what `rope_tables` cannot build, naming it and what is supported."""
    rope_type = rope_type_of(scaling)
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise UnsupportedRope(
            f"rope scaling {rope_type!r} is not supported; supported: "
            f"{', '.join(SUPPORTED_ROPE_TYPES)}"
        )


def frequencies_move(scaling: Mapping[str, Any] | None) -> bool:
    """Whether the variant's frequencies change with the position (longrope, dynamic NTK),
    so that turning a key from position p to p + d is no one rotation R(d)."""
    return rope_type_of(scaling) in _POSITION_DEPENDENT


def rotary_dims(head_dim: int, rotated: int) -> int | None:
    """`rotated` of a head's dimensions as ModelConfig.rotary_dim (None: all of them).
    Refuses what rotate_half cannot split: an odd count, none, or more than the head."""
    if rotated <= 0 or rotated % 2 or rotated > head_dim:
        raise UnsupportedRope(
            f"rope over {rotated} of {head_dim} head dimensions; an even count from 2 to "
            "head_dim is supported"
        )
    return None if rotated == head_dim else rotated


def _default_inv_freq(head_dim: int, theta: float | torch.Tensor) -> torch.Tensor:
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim
    return 1.0 / (theta**exponents)


def _llama3(inv_freq: torch.Tensor, scaling: Mapping[str, Any]) -> torch.Tensor:
    """Llama 3.1: keep high frequencies, divide low ones by `factor`, blend in between."""
    factor = scaling["factor"]
    low_freq_factor = scaling["low_freq_factor"]
    high_freq_factor = scaling["high_freq_factor"]
    old_context_len = scaling["original_max_position_embeddings"]
    low_freq_wavelen = old_context_len / low_freq_factor
    high_freq_wavelen = old_context_len / high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    inv_freq_llama = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_context_len / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
    smoothed = (1 - smooth) * inv_freq_llama / factor + smooth * inv_freq_llama
    is_medium = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
    return torch.where(is_medium, smoothed, inv_freq_llama)


def _yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def _yarn(
    head_dim: int, theta: float, scaling: Mapping[str, Any], max_positions: int
) -> tuple[torch.Tensor, float]:
    """YaRN: interpolate low frequencies by `factor`, keep high ones, ramp between the
    dimensions that turn beta_fast and beta_slow times over the original context; cos and
    sin are scaled by the attention factor (0.1 ln(factor) + 1, or the configured one)."""
    original = scaling["original_max_position_embeddings"]
    factor = scaling.get("factor") or max_positions / original
    attention_factor = scaling.get("attention_factor")
    if attention_factor is None:
        mscale, mscale_all_dim = scaling.get("mscale"), scaling.get("mscale_all_dim")
        if mscale and mscale_all_dim:
            attention_factor = _yarn_mscale(factor, mscale) / _yarn_mscale(factor, mscale_all_dim)
        else:
            attention_factor = _yarn_mscale(factor)
    beta_fast = scaling.get("beta_fast") or 32
    beta_slow = scaling.get("beta_slow") or 1

    def correction_dim(rotations: float) -> float:
        return head_dim * math.log(original / (rotations * 2 * math.pi)) / (2 * math.log(theta))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if scaling.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, head_dim - 1)
    if low == high:
        high += 0.001  # a zero-width ramp
    ramp = ((torch.arange(head_dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    extrapolation = 1 - ramp
    pos_freqs = theta ** (torch.arange(0, head_dim, 2).float() / head_dim)
    inv_freq = (1.0 / (factor * pos_freqs)) * (1 - extrapolation) + (
        1.0 / pos_freqs
    ) * extrapolation
    return inv_freq, float(attention_factor)


def _longrope_attention_factor(scaling: Mapping[str, Any], max_positions: int) -> float:
    if scaling.get("attention_factor") is not None:
        return float(scaling["attention_factor"])
    original = scaling["original_max_position_embeddings"]
    factor = scaling.get("factor") or max_positions / original
    return 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(original))


def _longrope_inv_freq(head_dim: int, theta: float, factors: list[float]) -> torch.Tensor:
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim
    return 1.0 / (torch.tensor(factors, dtype=torch.float32) * theta**exponents)


def rope_inv_freq(
    head_dim: int, theta: float, scaling: Mapping[str, Any] | None, max_positions: int
) -> tuple[torch.Tensor, float]:
    """Inverse frequencies [head_dim / 2] (float32, as transformers computes them) and the
    factor cos/sin are scaled by, for the variants whose frequencies do not move with the
    position. (longrope and dynamic: their frequencies inside the original context.)"""
    check_rope_scaling(scaling)
    scaling = scaling or {}
    rope_type = rope_type_of(scaling)
    inv_freq = _default_inv_freq(head_dim, theta)
    if rope_type == "linear":
        return inv_freq / scaling["factor"], 1.0
    if rope_type == "llama3":
        return _llama3(inv_freq, scaling), 1.0
    if rope_type == "freq_factors":
        return inv_freq / torch.tensor(scaling["freq_factors"], dtype=torch.float32), 1.0
    if rope_type == "proportional":
        # Gemma 4's full layers: the first partial_rotary_factor of the head's frequency
        # pairs turn as a whole head's would, the rest not at all (frequency 0), so the
        # unrotated dimensions sit in both halves of the head, not after the rotated ones.
        turning = int(scaling.get("partial_rotary_factor", 1.0) * head_dim // 2)
        inv_freq[turning:] = 0.0
        return inv_freq / scaling.get("factor", 1.0), 1.0
    if rope_type == "yarn":
        return _yarn(head_dim, theta, scaling, max_positions)
    if rope_type == "longrope":
        short = _longrope_inv_freq(head_dim, theta, scaling["short_factor"])
        return short, _longrope_attention_factor(scaling, max_positions)
    return inv_freq, 1.0  # default; dynamic inside its original context


def _position_freqs(
    head_dim: int, theta: float, scaling: Mapping[str, Any] | None, max_positions: int
) -> tuple[torch.Tensor, float]:
    """Rotation angles [max_positions, head_dim / 2] (float32) and the cos/sin factor."""
    positions = torch.arange(max_positions, dtype=torch.int64).float()
    inv_freq, attention_factor = rope_inv_freq(head_dim, theta, scaling, max_positions)
    rope_type = rope_type_of(scaling)
    if rope_type not in _POSITION_DEPENDENT:
        return positions[:, None] * inv_freq[None, :], attention_factor
    assert scaling is not None
    original = scaling["original_max_position_embeddings"]
    if rope_type == "longrope":
        long = _longrope_inv_freq(head_dim, theta, scaling["long_factor"])
        per_position = torch.where(positions[:, None] >= original, long, inv_freq)
    else:  # dynamic NTK: the base transformers uses for a sequence of p + 1 tokens
        factor = scaling["factor"]
        seq_len = torch.clamp(positions + 1, min=original)
        base = theta * ((factor * seq_len / original) - (factor - 1)) ** (head_dim / (head_dim - 2))
        per_position = _default_inv_freq(head_dim, base[:, None])
    return positions[:, None] * per_position, attention_factor


def rope_tables(
    head_dim: int,
    theta: float,
    scaling: Mapping[str, Any] | None,
    max_positions: int,
    dtype: torch.dtype,
    device: torch.device,
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sign-folded sin, each [max_positions, head_dim] in the model dtype (`head_dim`:
    the dimensions rotated, for a partial rotary its `rotary_dim`).

    Computed in fp32 then cast, like transformers (which also scales both by the variant's
    attention factor). The sin table carries rotate_half's minus sign on its first half, so
    applying rope is a swap of halves plus one addcmul.
    """
    freqs, attention_factor = _position_freqs(head_dim, theta, scaling, max_positions)
    cos = torch.cat((freqs, freqs), dim=-1).cos() * attention_factor
    sin = freqs.sin() * attention_factor
    signed_sin = torch.cat((-sin, sin), dim=-1)
    return cos.to(device=device, dtype=dtype), signed_sin.to(device=device, dtype=dtype)


def no_rope_tables(
    max_positions: int, dtype: torch.dtype, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    """Tables that rotate nothing ([max_positions, 0]): what a layer without RoPE indexes."""
    empty = torch.empty(max_positions, 0, dtype=dtype, device=device)
    return empty, empty


def mrope_components(section: tuple[int, int, int], interleaved: bool) -> torch.Tensor:
    """M-RoPE: which of a token's three positions (0 time, 1 height, 2 width) each column of
    the rotary tables turns by, [2 x sum(section)]. Qwen3-VL's frequencies take turns (t, h,
    w, t, h, w, ..., the last ones t: `interleaved`); Qwen2-VL's take a run each."""
    count = sum(section)
    if interleaved:
        component = torch.zeros(count, dtype=torch.long)
        for axis in (1, 2):
            component[axis : 3 * section[axis] : 3] = axis
    else:
        component = torch.repeat_interleave(torch.arange(3), torch.tensor(section))
    return torch.cat((component, component))


def grid_rope_rows(
    table: torch.Tensor, positions: torch.Tensor, components: torch.Tensor
) -> torch.Tensor:
    """A step's rows of a rotary table for tokens turning by three positions each
    (`positions` [3, T]: M-RoPE), [T, rotated]: column j of row i is the table's at the
    position of component `components[j]`, as transformers mixes the three positions'
    frequencies. A token whose three positions are one gets its plain row."""
    picked = table[positions]  # [3, T, rotated]
    index = components.to(positions.device).view(1, 1, -1).expand(1, *picked.shape[1:])
    return picked.gather(0, index)[0]


def apply_rope(x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor) -> torch.Tensor:
    """x [T, heads, head_dim] with cos/sin [T, 1, rotated]: x*cos + rotate_half(x)*sin over
    the first `rotated` dimensions of each head, the rest as they are."""
    rotated = cos.shape[-1]
    if rotated == 0:  # a layer without RoPE (SmolLM3's NoPE layers)
        return x
    if rotated < x.shape[-1]:
        return torch.cat((apply_rope(x[..., :rotated], cos, signed_sin), x[..., rotated:]), -1)
    half = rotated // 2
    swapped = torch.cat((x[..., half:], x[..., :half]), dim=-1)
    return torch.addcmul(x * cos, swapped, signed_sin)


def query_temperature_scales(
    positions: torch.Tensor, temperature: tuple[float, int]
) -> torch.Tensor:
    """Each position's query scale under Llama 4's attention temperature (Ministral 3's
    `llama_4_scaling_beta`, ModelConfig.query_temperature): 1 + beta * ln(1 + floor(p /
    length)), float32, as transformers computes it."""
    beta, length = temperature
    return 1 + beta * torch.log(1 + torch.floor(positions / length))


def served_rope(
    scaling: Mapping[str, Any] | None, max_positions: int, original: int | None = None
) -> tuple[dict[str, Any] | None, int]:
    """A checkpoint's rope dict (HF keys) -> (the scaling rope_tables reads, or None for plain
    RoPE; the number of positions served).

    `original` is the pretraining context when the config keeps it outside the dict (Phi-3's
    top-level original_max_position_embeddings). Dynamic NTK scales past max_position_embeddings
    (which transformers treats as the original context), YaRN past its original context, by
    `factor`: both are served that far. Raises UnsupportedRope for what is not run.
    """
    check_rope_scaling(scaling)
    rope = {k: v for k, v in (scaling or {}).items() if k not in ("rope_theta", "type")}
    rope_type = rope["rope_type"] = rope_type_of(scaling)
    if rope_type != "proportional":  # a share of the head's frequencies, in the tables
        rope.pop("partial_rotary_factor", None)
    if rope_type == "default":
        return None, max_positions
    if rope_type == "dynamic":
        rope["original_max_position_embeddings"] = max_positions
        return rope, int(max_positions * rope["factor"])
    rope.setdefault("original_max_position_embeddings", original or max_positions)
    if rope_type == "longrope":
        # The attention factor follows the served context over the original (Phi-3's configs
        # give no factor), not the length of whatever table is built first.
        rope.setdefault("factor", max_positions / rope["original_max_position_embeddings"])
    if rope_type == "yarn":
        extended = int(rope["original_max_position_embeddings"] * (rope.get("factor") or 1))
        return rope, max(max_positions, extended)
    return rope, max_positions
