"""LoRA adapters as the scheduler sees them: a request's adapter, and which adapters hold the
model's slots.

The model keeps at most `max_loras` adapters in slot tensors at once (model/lora_linear.py);
every row of a step runs the base model or one resident adapter. The slots are assigned here,
at admission, so a step never names more adapters than there are slots: an adapter with no
running request may be evicted (least recently used) to make room, one with running requests
never is. Pure Python: no torch.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable
from dataclasses import dataclass


@dataclass(frozen=True)
class LoRARequest:
    """vLLM's `LoRARequest`: an adapter by name, a positive id unique per adapter (the
    prefix cache and the slots key by it), and where its weights are."""

    lora_name: str
    lora_int_id: int
    lora_path: str = ""

    def __post_init__(self) -> None:
        if self.lora_int_id < 1:
            raise ValueError(
                f"lora_int_id must be at least 1 (0 is the base), got {self.lora_int_id}"
            )


class LoRASlots:
    """Which adapter (by id) holds each of `max_loras` slots, least recently used first."""

    def __init__(self, max_loras: int) -> None:
        self.max_loras = max_loras
        self._slot_of: OrderedDict[int, int] = OrderedDict()  # lora id -> slot, LRU order

    def slot_of(self, lora_id: int) -> int:
        """The adapter's slot; -1 for the base model (id 0) or an adapter not resident."""
        return self._slot_of.get(lora_id, -1)

    @property
    def resident(self) -> list[int]:
        return list(self._slot_of)

    def acquire(self, lora_id: int, busy: Iterable[int]) -> int | None:
        """A slot holding `lora_id` (resident already, a free one, or the least recently used
        adapter's that no running request uses: `busy` are the ids in use); None if every
        slot is busy."""
        slot = self._slot_of.get(lora_id)
        if slot is not None:
            self._slot_of.move_to_end(lora_id)
            return slot
        taken = set(self._slot_of.values())
        free = [s for s in range(self.max_loras) if s not in taken]
        if not free:
            in_use = set(busy)
            victim = next((lid for lid in self._slot_of if lid not in in_use), None)
            if victim is None:
                return None
            free = [self._slot_of.pop(victim)]
        self._slot_of[lora_id] = free[0]
        return free[0]

    def evict(self, lora_id: int) -> None:
        """Forget an adapter (unloaded): its slot is free for the next."""
        self._slot_of.pop(lora_id, None)
