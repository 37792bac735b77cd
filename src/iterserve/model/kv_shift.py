"""Cached K/V moved to other positions: the executor's half of `--cache-reuse`.

The scheduler plans which rows go where (core/kv_reuse.py: KVCopy, slot to slot, and by how
many positions). A key cached at position p holds R(p) k, where R turns each pair of
dimensions by the angle p * frequency; R(d) R(p) = R(p + d), so turning the cached key by
d * frequency puts it at p + d without its k. Values have no position and move as they are.
A layer's frequencies are those its tables were built from (model/rope.py): the model's, a
windowed layer's own base (Gemma 3), or none (a layer without RoPE). YaRN's and longrope's
attention factor scales a cached key already; R(d) turns it and leaves its length.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from iterserve.core.kv_reuse import KVCopy
from iterserve.model.config import ModelConfig
from iterserve.model.kv_cache_format import dequantize_rows, is_quantized, quantize_rows
from iterserve.model.rope import frequencies_move, rope_inv_freq


class UnsupportedKVShift(ValueError):
    """A model whose cached K/V cannot move to other positions; the message says why."""


@dataclass(frozen=True)
class _LayerCache:
    keys: torch.Tensor  # [kv_heads, blocks * block_size, width]: one row a slot
    values: torch.Tensor
    inv_freq: torch.Tensor | None  # the rotated pairs' frequencies (float64); None: no RoPE


def layer_frequencies(config: ModelConfig, index: int, positions: int) -> torch.Tensor | None:
    """The frequencies of the dimension pairs layer `index` turns its keys by (None: it does
    not rotate); `positions`, the model's rotary table length (YaRN without a factor)."""
    local = config.local_rope_theta is not None and config.layer_window(index) > 0
    if local:  # Gemma's windowed layers: plain RoPE of their own base
        inv_freq, _ = rope_inv_freq(config.local_rope_dim, config.local_rope_theta, None, positions)
    elif not config.layer_rotates(index):
        return None
    else:
        inv_freq, _ = rope_inv_freq(
            config.rope_dim, config.rope_theta, config.rope_scaling, positions
        )
    return inv_freq.double()


class KVShifter:
    """Moves rows of a paged KV pool (model/attention.py allocate_kv_caches) between slots,
    turning the keys by the distance moved."""

    def __init__(
        self,
        config: ModelConfig,
        kv_caches: Sequence[tuple[torch.Tensor, torch.Tensor]],
        rope_positions: int,
    ) -> None:
        if config.conv_history:
            raise UnsupportedKVShift(
                "--cache-reuse: this model's convolution layers keep a state of earlier tokens, "
                "which does not move with a position"
            )
        if frequencies_move(config.rope_scaling):
            raise UnsupportedKVShift(
                "--cache-reuse: this model's RoPE frequencies change with the position "
                f"({config.rope_scaling}), so a key cannot be turned to another place"
            )
        self.layers: list[_LayerCache] = []
        for index, (keys, values) in enumerate(kv_caches):
            if config.layer_kv_source(index) != index:
                continue  # reads an earlier layer's pool (Gemma 4), moved with it
            heads, width = keys.shape[0], keys.shape[-1]
            self.layers.append(
                _LayerCache(
                    keys.view(heads, -1, width),
                    values.view(values.shape[0], -1, values.shape[-1]),
                    layer_frequencies(config, index, rope_positions),
                )
            )

    @torch.inference_mode()
    def apply(self, copies: Sequence[KVCopy]) -> None:
        for copy in copies:
            device = self.layers[0].keys.device
            src = torch.tensor(copy.src_slots, dtype=torch.long, device=device)
            dst = torch.tensor(copy.dst_slots, dtype=torch.long, device=device)
            for layer in self.layers:
                keys = layer.keys.index_select(1, src)
                if layer.inv_freq is not None and copy.shift:
                    keys = turned_keys(keys, layer.inv_freq, copy.shift)
                layer.keys.index_copy_(1, dst, keys)
                layer.values.index_copy_(1, dst, layer.values.index_select(1, src))


def turned_keys(rows: torch.Tensor, inv_freq: torch.Tensor, shift: int) -> torch.Tensor:
    """Cached keys [heads, n, width] (int8 rows quantized again after) turned by `shift`
    positions over their first 2 * len(inv_freq) dimensions, in float32."""
    quantized = is_quantized(rows)
    x = dequantize_rows(rows, torch.float32) if quantized else rows.float()
    angle = shift * inv_freq  # float64: a long shift's angle loses nothing before cos/sin
    cos = torch.cat((angle.cos(), angle.cos())).float()
    signed_sin = torch.cat((-angle.sin(), angle.sin())).float()
    rotated = cos.shape[0]
    half = rotated // 2
    head = x[..., :rotated]
    swapped = torch.cat((head[..., half:], head[..., :half]), dim=-1)
    x = torch.cat((head * cos + swapped * signed_sin, x[..., rotated:]), dim=-1)
    return quantize_rows(x) if quantized else x.to(rows.dtype)
