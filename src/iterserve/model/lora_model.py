"""A network made to serve LoRA adapters: each decoder layer's projections wrapped with
slots (model/lora_linear.py), and the adapters checked against it and copied into slots.

The fused C++ layer op has no place for the deltas, so such a network runs its layers op by
op (the tiled projections and the C++ attention still), and eager: a step's LoRA batch is
Python state the compiled graph would have to guard on.
"""

from __future__ import annotations

import torch

from iterserve.model.llama import LlamaForCausalLM, _DecoderLayer
from iterserve.model.lora_linear import LoRALinear, LoRAState, slot_dtype
from iterserve.model.lora_weights import AdapterWeights


def _part_rows(layer: _DecoderLayer, name: str) -> list[int]:
    """Output rows of each checkpoint part of one of the layer's fused projections."""
    hidden = layer.input_norm.shape[0]
    fused_in_checkpoint = len(layer.checkpoint_parts["qkv"]) == 1
    rows = {
        "qkv": [layer.q_size + 2 * layer.kv_size]
        if fused_in_checkpoint
        else [layer.q_size, layer.kv_size, layer.kv_size],
        "o": [hidden],
        "gate_up": [2 * layer.intermediate]
        if fused_in_checkpoint
        else [layer.intermediate, layer.intermediate],
        "down": [hidden],
    }
    return rows[name]


class LoRAModel:
    """The LoRA side of one network: its slotted projections and the step's batch."""

    def __init__(self, model: LlamaForCausalLM, max_loras: int, max_rank: int) -> None:
        self.state = LoRAState()
        self.max_loras = max_loras
        self.max_rank = max_rank
        self.linears: list[LoRALinear] = []
        # Each adaptable module's (out, in), by HF module path: what an adapter is checked on.
        self.shapes: dict[str, tuple[int, int]] = {}
        for layer in model.layers:
            assert isinstance(layer, _DecoderLayer)
            for name, linear in list(layer.linears.items()):
                parts = [
                    (f"model.layers.{layer.index}.{part}", rows)
                    for part, rows in zip(
                        layer.checkpoint_parts[name], _part_rows(layer, name), strict=True
                    )
                ]
                wrapped = LoRALinear(
                    linear,
                    parts,
                    self.state,
                    max_loras,
                    max_rank,
                    slot_dtype(model.dtype, model.device),
                    model.device,
                )
                layer.linears[name] = wrapped  # type: ignore[assignment]
                self.linears.append(wrapped)
                self.shapes.update({part: (rows, linear.in_features) for part, rows in parts})
        model.fused_layers = False  # the C++ layer op cannot add the deltas
        model.lora = self

    def load_slot(self, slot: int, adapter: AdapterWeights) -> None:
        with torch.inference_mode():
            for linear in self.linears:
                linear.load_slot(slot, adapter.modules)

    @property
    def nbytes(self) -> int:
        tensors = [t for lin in self.linears for t in (lin.a_t, *(b for _, b in lin.b_parts))]
        return sum(t.numel() * t.element_size() for t in tensors)
