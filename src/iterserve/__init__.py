"""iterserve: an LLM serving engine built around iteration-level scheduling.

`from iterserve import LLM, SamplingParams`. The heavy parts (torch, the model)
load on first use, so `iterserve.core` stays importable without torch.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from iterserve.sampling_params import SamplingParams
from iterserve.structured_output import StructuredOutput

if TYPE_CHECKING:
    from iterserve.config import EngineConfig
    from iterserve.engine.llm import LLM

__all__ = ["LLM", "EngineConfig", "SamplingParams", "StructuredOutput"]


def __getattr__(name: str) -> Any:
    if name == "LLM":
        from iterserve.engine.llm import LLM

        return LLM
    if name == "EngineConfig":
        from iterserve.config import EngineConfig

        return EngineConfig
    raise AttributeError(f"module 'iterserve' has no attribute {name!r}")
