"""The adapters an engine serves, by name: added from --lora-modules, by the server at run
time, or by the first offline request naming one (`LLM.generate(lora_request=...)`).

Adding reads the adapter and checks it against the model before anything changes, so a bad
adapter is refused (an InvalidRequestError naming `lora_path`) and the engine serves on.
Removing takes the name away at once; the weights go when no request of it is left (a
request already running finishes with its adapter).
"""

from __future__ import annotations

from iterserve.config import LoRAConfig
from iterserve.core.lora import LoRARequest
from iterserve.core.scheduler import Scheduler
from iterserve.executor.lora_adapters import LoRAAdapters
from iterserve.model.config import ModelConfig
from iterserve.model.lora_weights import LoRAError, check_adapter, load_adapter
from iterserve.sampling_params import InvalidRequestError


class LoRARegistry:
    def __init__(
        self,
        config: LoRAConfig,
        adapters: LoRAAdapters | None,
        model_config: ModelConfig,
        scheduler: Scheduler,
    ) -> None:
        self.config = config
        self.adapters = adapters
        self.model_config = model_config
        self.scheduler = scheduler
        self.by_name: dict[str, LoRARequest] = {}
        self._retired: set[int] = set()  # removed, but requests of them may still run
        self._last_id = 0

    @property
    def enabled(self) -> bool:
        return self.adapters is not None

    def next_id(self) -> int:
        """An id no adapter of this engine had (the prefix cache keys by it: a name loaded
        again from another path must not find the old one's blocks)."""
        return self._last_id + 1

    def add(self, lora: LoRARequest) -> None:
        """Serve `lora` under its name; raises InvalidRequestError (nothing changed) if it
        cannot serve this model."""
        if self.adapters is None:
            raise InvalidRequestError(
                "this engine serves no LoRA adapters: start it with --enable-lora (or "
                "--lora-modules)",
                "lora_name",
            )
        known = self.by_name.get(lora.lora_name)
        if known is not None:
            if known == lora:
                return
            raise InvalidRequestError(
                f"a LoRA adapter named {lora.lora_name!r} is loaded already (id "
                f"{known.lora_int_id}, {known.lora_path!r}); unload it first",
                "lora_name",
            )
        if lora.lora_int_id in self.adapters.weights or lora.lora_int_id in self._retired:
            raise InvalidRequestError(
                f"lora_int_id {lora.lora_int_id} belongs to another adapter", "lora_int_id"
            )
        try:
            weights = load_adapter(lora.lora_path, self.model_config)
            check_adapter(
                weights, self.adapters.model.shapes, self.config.max_lora_rank, repr(lora.lora_path)
            )
        except LoRAError as error:
            raise InvalidRequestError(str(error), "lora_path") from None
        self.adapters.add(lora.lora_int_id, weights)
        self.by_name[lora.lora_name] = lora
        self._last_id = max(self._last_id, lora.lora_int_id)

    def remove(self, name: str) -> LoRARequest:
        lora = self.by_name.pop(name, None)
        if lora is None:
            raise InvalidRequestError(f"no LoRA adapter named {name!r} is loaded", "lora_name")
        self._retired.add(lora.lora_int_id)
        self.sweep()
        return lora

    def sweep(self) -> None:
        """Drop the weights of removed adapters no request runs any more."""
        if self.adapters is None or not self._retired:
            return
        live = self.scheduler.lora_ids()
        for lora_id in self._retired - live:
            self.adapters.remove(lora_id)
            self.scheduler.lora_slots.evict(lora_id)
            self._retired.discard(lora_id)

    def resolve(self, lora: LoRARequest) -> LoRARequest:
        """The adapter a new request runs: added now if the engine has not seen it."""
        if self.by_name.get(lora.lora_name) != lora:
            self.add(lora)
        return lora

    @property
    def num_resident(self) -> int:
        return len(self.scheduler.lora_slots.resident)
