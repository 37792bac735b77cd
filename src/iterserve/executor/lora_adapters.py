"""The executor's side of LoRA: the adapters it knows (by id, their weights in memory) and
which one each of the model's slots holds, so a step's slots hold what the scheduler
assigned (core/lora.py) before the step runs.

A slot is loaded (a copy of the adapter's matrices into the slot tensors) only when the
scheduler gave it to another adapter; adapters stay in memory while registered, so making
one resident again never reads its files.
"""

from __future__ import annotations

from collections.abc import Sequence

from iterserve.core.outputs import ScheduledSeq
from iterserve.model.lora_model import LoRAModel
from iterserve.model.lora_weights import AdapterWeights


class LoRAAdapters:
    def __init__(self, model: LoRAModel) -> None:
        self.model = model
        self.weights: dict[int, AdapterWeights] = {}
        self._held: list[int] = [0] * model.max_loras  # adapter id in each slot (0: none)
        self.num_slot_loads = 0

    def add(self, lora_id: int, weights: AdapterWeights) -> None:
        self.weights[lora_id] = weights

    def remove(self, lora_id: int) -> None:
        """Forget an adapter's weights (no request of it may run after this)."""
        self.weights.pop(lora_id, None)
        self._held = [0 if held == lora_id else held for held in self._held]

    def prepare(self, seqs: Sequence[ScheduledSeq]) -> None:
        """Load into each slot the step names the adapter it names there."""
        for seq in seqs:
            slot = seq.lora_slot
            if slot >= 0 and self._held[slot] != seq.lora_id:
                self.model.load_slot(slot, self.weights[seq.lora_id])
                self._held[slot] = seq.lora_id
                self.num_slot_loads += 1
