"""An `LLM` that speculates with a draft model, as the speculation, sampling-control and
structured-output tests build it (float32 and eager, so greedy texts compare exactly)."""

from __future__ import annotations

from pathlib import Path

from iterserve.engine.llm import LLM


def draft_llm(target: Path, draft: Path, **settings: object) -> LLM:
    return LLM(
        str(target),
        dtype="float32",
        compile=False,
        speculative_method="draft",
        draft_model=str(draft),
        **settings,
    )
