"""A model's own sampling settings, for the fields a request leaves unset: what its makers put
in generation_config.json (Qwen3: temperature 0.6, top_k 20, top_p 0.95), or the
`general.sampling.*` keys of a GGUF. vLLM applies the first by default (`--generation-config
auto`), llama.cpp the second; without them a request that names no temperature samples at
OpenAI's 1.0 with no cut, which such models are not made for. `--generation-config none`
keeps OpenAI's defaults."""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import asdict, dataclass, replace
from typing import Any

from iterserve.sampling_params import InvalidRequestError, SamplingParams

logger = logging.getLogger(__name__)

# generation_config.json's names; a GGUF's keys for the same settings, which llama.cpp's
# converter writes from that file (gguf-py's Metadata.load). `penalty_repeat` comes from its
# `repetition_penalty`, and is applied as its makers meant it, as vLLM does: over the prompt
# and every generated token (llama.cpp counts the last `penalty_last_n`, 64, only).
_GGUF_KEYS = {
    "temperature": "general.sampling.temp",
    "top_k": "general.sampling.top_k",
    "top_p": "general.sampling.top_p",
    "min_p": "general.sampling.min_p",
    "repetition_penalty": "general.sampling.penalty_repeat",
}


def _usable(name: str, value: Any) -> bool:
    """Whether a request could send `value` for `name`: a number (not a bool; top_k a whole
    one) that SamplingParams' own checks take."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        return False
    if name == "top_k" and not float(value).is_integer():
        return False
    try:
        SamplingParams(**{name: int(value) if name == "top_k" else float(value)})
    except InvalidRequestError:
        return False
    return True


@dataclass(frozen=True)
class SamplingDefaults:
    """A model's settings for the fields a request leaves unset (None: OpenAI's)."""

    temperature: float | None = None
    top_k: int | None = None
    top_p: float | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None

    @classmethod
    def from_generation_config(cls, generation: Mapping[str, Any] | None) -> SamplingDefaults:
        """From an HF checkpoint's generation_config.json (None: it has none)."""
        return cls._checked({name: (generation or {}).get(name) for name in cls._names()})

    @classmethod
    def from_gguf(cls, metadata: Mapping[str, Any]) -> SamplingDefaults:
        """From a GGUF's `general.sampling.*` keys."""
        return cls._checked({name: metadata.get(key) for name, key in _GGUF_KEYS.items()})

    @classmethod
    def _names(cls) -> tuple[str, ...]:
        return tuple(cls.__dataclass_fields__)

    @classmethod
    def _checked(cls, values: Mapping[str, Any]) -> SamplingDefaults:
        """The values a request could take; another (a top_p of 0, a negative temperature)
        is left out with a warning, rather than make every request that relies on it a 400."""
        kept: dict[str, Any] = {}
        for name, value in values.items():
            if value is None:
                continue
            if _usable(name, value):
                kept[name] = int(value) if name == "top_k" else float(value)
            else:
                logger.warning(
                    "the model's sampling default %s=%r is not usable; left out", name, value
                )
        return cls(**kept)

    def with_overrides(self, settings: Mapping[str, Any]) -> SamplingDefaults:
        """These settings with a user's over them (--override-generation-config); ValueError
        naming one that is not a setting here, or not a value a request could send."""
        for name, value in settings.items():
            if name not in self._names():
                raise ValueError(f"{name!r} is not one of {', '.join(self._names())}")
            if not _usable(name, value):
                raise ValueError(f"{name}={value!r} is not a value a request could send")
        return replace(
            self, **{n: int(v) if n == "top_k" else float(v) for n, v in settings.items()}
        )

    def given(self) -> dict[str, float | int]:
        """The settings the model gives, by SamplingParams' names."""
        return {name: value for name, value in asdict(self).items() if value is not None}

    def describe(self) -> str:
        given = self.given()
        return ", ".join(f"{name} {value:g}" for name, value in given.items()) or "OpenAI's"
