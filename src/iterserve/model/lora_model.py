"""A network made to serve LoRA adapters: each decoder layer's projections wrapped with
slots (model/lora_linear.py), and the adapters checked against it and copied into slots.

On the fast path the fused C++ layer op adds the deltas itself (it takes the layer's slots and
the step's rows' slots: `LayerSlots`); otherwise the layers run op by op, and eager: a step's
LoRA batch is Python state a compiled graph would have to guard on.
"""

from __future__ import annotations

import torch

from iterserve.model.llama import _FUSED, _NO_LORA, LlamaForCausalLM, _DecoderLayer
from iterserve.model.lora_linear import LoRALinear, LoRAState
from iterserve.model.lora_weights import AdapterWeights


def _part_rows(layer: _DecoderLayer, name: str) -> list[int]:
    """Output rows of each checkpoint part of one of the layer's fused projections."""
    hidden = layer.hidden_size
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


class LayerSlots:
    """One layer's LoRA slots as the fused C++ layer op takes them: every projection's A and
    B's in one list, how many B's each has, and the step's rows' slots."""

    def __init__(self, state: LoRAState, linears: list[LoRALinear]) -> None:
        self.state = state
        self.tensors = [t for lin in linears for t in (lin.a, *lin.b_stacks)]
        self.parts = [len(lin.b_stacks) for lin in linears]

    def kernel_args(self) -> tuple[list[torch.Tensor], list[int], torch.Tensor | None]:
        batch = self.state.batch
        return _NO_LORA if batch is None else (self.tensors, self.parts, batch.row_slots)


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
            wrapped_here = []
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
                    model.dtype,
                    model.device,
                )
                layer.linears[name] = wrapped  # type: ignore[assignment]
                wrapped_here.append(wrapped)
                self.shapes.update({part: (rows, linear.in_features) for part, rows in parts})
            self.linears.extend(wrapped_here)
            # A layer of experts has no gate_up or down of its own for the layer op to slot.
            fusable = layer.fused is not None and layer.moe is None
            if fusable and all(w.kernel_ops is not None for w in wrapped_here):
                layer.lora_slots = LayerSlots(self.state, [layer.linears[n] for n in _FUSED])
            else:
                layer.fused = None  # its layer op could not add the deltas: op by op
        model.fused_layers = all(layer.fused is not None for layer in model.layers)
        model.lora = self

    def load_slot(self, slot: int, adapter: AdapterWeights) -> None:
        with torch.inference_mode():
            for linear in self.linears:
                linear.load_slot(slot, adapter.modules)

    @property
    def nbytes(self) -> int:
        tensors = [t for lin in self.linears for t in (lin.a, *lin.b_stacks)]
        return sum(t.numel() * t.element_size() for t in tensors)
