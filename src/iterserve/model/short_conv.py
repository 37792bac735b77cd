"""LFM2's short convolution: the layer that mixes tokens in place of attention on most of
its layers.

A token's normed row is projected to three rows, B, C and x; B * x goes through a causal
depthwise convolution over the last `conv_kernel` tokens (3 in every released LFM2: the
token and its two predecessors), and C gates what comes out before the output projection.

Where a recurrent model's engine keeps one state per sequence (vLLM's, llama.cpp's), B * x
is kept here for every token, in the paged pool beside the attention layers' K/V (one row of
hidden_size a token, model/attention.py `allocate_kv_caches`), and the convolution reads a
token's predecessors through the block table as attention reads K. So a conv layer needs
nothing the engine does not already do for attention: prefix caching shares its rows,
preemption and chunked prefill recompute or continue them, and a rejected speculative token's
row is overwritten as its K/V is. It costs a row a token per conv layer (LFM2-1.2B: 40 KiB a
token in bf16 against its attention layers' 12), where a state per sequence would take one
row per predecessor read.

The fused C++ layer op runs the same convolution (kernels/csrc/short_conv.cpp, inside
`decoder_stack`: the conv layer's in_proj and out_proj are its q/k/v and o segments), to the
bit (tests/model/test_short_conv.py); this module is its reference, and the road of every
other backend.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from iterserve.model.attention import current_step
from iterserve.model.config import ModelConfig
from iterserve.model.kv_cache_format import dequantize_rows, is_quantized, quantize_rows
from iterserve.model.linear import Backend, Linear, WeightMode, WeightPart

# Its checkpoint names under model.layers.N (LFM2's; model/gguf_loader.py maps llama.cpp's
# shortconv.* to them). The convolution's weight is [hidden, 1, kernel], as nn.Conv1d keeps it.
IN_PROJ = "conv.in_proj.weight"
OUT_PROJ = "conv.out_proj.weight"
KERNEL = "conv.conv.weight"


class ShortConv(nn.Module):
    def __init__(
        self, config: ModelConfig, index: int, dtype: torch.dtype, device: torch.device
    ) -> None:
        super().__init__()
        self.index = index
        self.hidden = config.hidden_size
        self.dtype = dtype
        self.weight = nn.Parameter(
            torch.empty(self.hidden, 1, config.conv_kernel, dtype=dtype, device=device), False
        )
        self.in_proj: Linear | None = None
        self.out_proj: Linear | None = None

    def targets(self, prefix: str) -> dict[str, tuple[torch.Tensor | None, tuple[int, ...]]]:
        """HF name -> (destination of a small tensor, or None for a projection's part built by
        `build`; expected shape)."""
        hidden = self.hidden
        return {
            prefix + IN_PROJ: (None, (3 * hidden, hidden)),
            prefix + OUT_PROJ: (None, (hidden, hidden)),
            prefix + KERNEL: (self.weight, tuple(self.weight.shape)),
        }

    def build(self, part: Callable[[str], WeightPart], backend: Backend, mode: WeightMode) -> None:
        """Its two Linears from their checkpoint tensors (`part(name)`, by the name under the
        layer), on the layer's kernels."""
        self.in_proj = Linear([part(IN_PROJ)], None, backend, mode, self.dtype)
        self.out_proj = Linear([part(OUT_PROJ)], None, backend, mode, self.dtype)

    def linears(self) -> list[Linear]:
        return [lin for lin in (self.in_proj, self.out_proj) if lin is not None]

    def forward(self, x: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        """`residual` + out_proj(C * conv(B * x)), x the normed rows of the step."""
        assert self.in_proj is not None and self.out_proj is not None
        b, c, v = self.in_proj(x).split(self.hidden, dim=1)
        mixed = short_conv(b * v, self.weight.view(self.hidden, -1), self.index)
        return self.out_proj(c * mixed, residual=residual)


@torch.library.custom_op("iterserve::short_conv", mutates_args=())
def short_conv(bx: torch.Tensor, weight: torch.Tensor, layer: int) -> torch.Tensor:
    """Store the step's B * x rows [T, hidden] in layer `layer`'s rows of the pool, then each
    token's causal convolution over its predecessors' rows and its own: weight [hidden,
    kernel], the oldest token first. An opaque op, as `attend` is: a compiled graph never sees
    the pool or the step's slots (model/attention.py `attention_context`)."""
    meta, kv_caches = current_step()
    assert meta.conv_slots is not None, "a conv layer's step needs conv_slots (conv_history)"
    cache = kv_caches[layer][0]
    rows = cache.view(-1, cache.shape[-1])
    quantized = is_quantized(cache)
    rows.index_copy_(0, meta.slot_mapping, quantize_rows(bx) if quantized else bx.to(rows.dtype))
    slots = meta.conv_slots
    past = rows.index_select(0, slots.clamp(min=0).view(-1)).view(*slots.shape, -1)
    past = dequantize_rows(past, bx.dtype) if quantized else past
    # Before a sequence's first token: zeros, as the convolution's left padding.
    past = past.masked_fill(slots[..., None] < 0, 0)
    window = torch.cat([past, bx[:, None]], dim=1).float()
    return (window * weight.T.float()).sum(1).to(bx.dtype)


@short_conv.register_fake
def _(bx: torch.Tensor, *_: object) -> torch.Tensor:
    return torch.empty_like(bx, memory_format=torch.contiguous_format)
