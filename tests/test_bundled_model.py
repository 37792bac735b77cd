"""The bundled SmolLM2-135M-Instruct through the whole engine (bf16, the default)."""

from __future__ import annotations

import pytest

from iterserve import LLM, SamplingParams


@pytest.fixture(scope="module")
def llm() -> LLM:
    return LLM(max_num_seqs=8)


def test_capital_of_france_is_paris(llm: LLM) -> None:
    out = llm.generate(
        "The capital of France is", SamplingParams(temperature=0, max_tokens=4), use_tqdm=False
    )[0]
    assert out.text.startswith(" Paris"), out.text


def test_chat_template_from_the_gguf(llm: LLM) -> None:
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    out = llm.chat(messages, SamplingParams(temperature=0, max_tokens=24), use_tqdm=False)[0]
    assert "Paris" in out.text
    assert out.finish_reason in ("stop", "length")
