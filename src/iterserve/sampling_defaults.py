"""A model's own sampling settings, for the fields a request leaves unset: what its makers put
in generation_config.json (Qwen3: temperature 0.6, top_k 20, top_p 0.95), or the
`general.sampling.*` keys of a GGUF. vLLM applies the first by default (`--generation-config
auto`), llama.cpp the second; without them a request that names no temperature samples at
OpenAI's 1.0 with no cut, which such models are not made for. `--generation-config none`
keeps OpenAI's defaults, and `--generation-config FOLDER` takes another generation_config.json
than the checkpoint's, as vLLM's does.

A `max_new_tokens` in generation_config.json is, as vLLM reads it, a limit on every request's
answer: one that asks for more, or for no limit, gets that many tokens at most."""

from __future__ import annotations

import json
import logging
from collections.abc import Mapping
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

from iterserve.sampling_params import InvalidRequestError, SamplingParams

logger = logging.getLogger(__name__)

# SamplingParams' names -> generation_config.json's (also --override-generation-config's).
_HF_NAMES = {
    "temperature": "temperature",
    "top_k": "top_k",
    "top_p": "top_p",
    "min_p": "min_p",
    "repetition_penalty": "repetition_penalty",
    "max_tokens": "max_new_tokens",
}
_WHOLE = ("top_k", "max_tokens")  # whole numbers; the others are floats
# A GGUF's keys for the same settings, which llama.cpp's
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
    """Whether a request could send `value` for `name`: a number (not a bool; top_k and
    max_tokens whole ones) that SamplingParams' own checks take."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        return False
    if name in _WHOLE and not float(value).is_integer():
        return False
    try:
        SamplingParams(**{name: _typed(name, value)})
    except InvalidRequestError:
        return False
    return True


def _typed(name: str, value: float) -> float | int:
    return int(value) if name in _WHOLE else float(value)


def read_generation_config(path: str | Path) -> dict[str, Any]:
    """--generation-config FOLDER: the generation_config.json in it (or the file itself);
    ValueError saying what is wrong."""
    path = Path(path).expanduser()
    file = path / "generation_config.json" if path.is_dir() else path
    try:
        value = json.loads(file.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise ValueError(
            f"{str(path)!r} is not auto, none, or a folder holding generation_config.json"
        ) from None
    except (OSError, ValueError) as error:
        raise ValueError(f"cannot read {file}: {error}") from None
    if not isinstance(value, dict):
        raise ValueError(f"{file} does not hold a JSON object")
    return value


@dataclass(frozen=True)
class SamplingDefaults:
    """A model's settings for the fields a request leaves unset (None: OpenAI's)."""

    temperature: float | None = None
    top_k: int | None = None
    top_p: float | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    max_tokens: int | None = None  # max_new_tokens: a limit, not only a default

    @classmethod
    def from_generation_config(cls, generation: Mapping[str, Any] | None) -> SamplingDefaults:
        """From an HF checkpoint's generation_config.json (None: it has none)."""
        return cls._checked({name: (generation or {}).get(hf) for name, hf in _HF_NAMES.items()})

    @classmethod
    def from_gguf(cls, metadata: Mapping[str, Any]) -> SamplingDefaults:
        """From a GGUF's `general.sampling.*` keys."""
        return cls._checked({name: metadata.get(key) for name, key in _GGUF_KEYS.items()})

    @classmethod
    def _checked(cls, values: Mapping[str, Any]) -> SamplingDefaults:
        """The values a request could take; another (a top_p of 0, a negative temperature)
        is left out with a warning, rather than make every request that relies on it a 400."""
        kept: dict[str, Any] = {}
        for name, value in values.items():
            if value is None:
                continue
            if _usable(name, value):
                kept[name] = _typed(name, value)
            else:
                logger.warning(
                    "the model's sampling default %s=%r is not usable; left out", name, value
                )
        return cls(**kept)

    def with_overrides(self, settings: Mapping[str, Any]) -> SamplingDefaults:
        """These settings with a user's over them (--override-generation-config, by
        generation_config.json's names); ValueError naming one that is not a setting here,
        or not a value a request could send."""
        ours = {hf: name for name, hf in _HF_NAMES.items()}
        for hf, value in settings.items():
            if hf not in ours:
                raise ValueError(f"{hf!r} is not one of {', '.join(ours)}")
            if not _usable(ours[hf], value):
                raise ValueError(f"{hf}={value!r} is not a value a request could send")
        return replace(self, **{ours[hf]: _typed(ours[hf], v) for hf, v in settings.items()})

    def limit(self, max_tokens: int) -> int:
        """A request's token limit under the model's max_new_tokens (vLLM's rule)."""
        return max_tokens if self.max_tokens is None else min(max_tokens, self.max_tokens)

    def given(self) -> dict[str, float | int]:
        """The settings the model gives, by SamplingParams' names."""
        return {name: value for name, value in asdict(self).items() if value is not None}

    def describe(self) -> str:
        given = self.given()
        return ", ".join(f"{name} {value:g}" for name, value in given.items()) or "OpenAI's"
