"""/v1/completions' `prompt_embeds` (vLLM's, with --enable-prompt-embeds) through a real server
and the official client: a prompt's rows, made by transformers from the same weights, answer
as its text does, whole and streamed, beside text prompts in one request (the rows' choices
first, as vLLM orders them); bad rows are a 400 naming the field, and nothing is lost."""

from __future__ import annotations

import base64
import io
from dataclasses import replace
from pathlib import Path
from typing import Any

import openai
import pytest
import torch

from iterserve.engine.async_engine import AsyncEngine
from iterserve.engine.llm_engine import LLMEngine
from server_fixtures import MODEL_NAME, RunningServer, engine_config, running_server, serving

PROMPT = "Once upon a time, in a land far away, there lived a"
OTHER = "1 2 3"


def as_base64(value: Any) -> str:
    buffer = io.BytesIO()
    torch.save(value, buffer)
    return base64.b64encode(buffer.getvalue()).decode()


@pytest.fixture(scope="module")
def rows(tiny_llama_dir: Path) -> torch.Tensor:
    """PROMPT's token embeddings, as transformers makes them (vLLM's own example's way)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_llama_dir)
    model = AutoModelForCausalLM.from_pretrained(tiny_llama_dir, dtype=torch.float32)
    with torch.no_grad():
        return model.get_input_embeddings()(torch.tensor(tokenizer.encode(PROMPT)))


@pytest.fixture(scope="module")
def server(tiny_llama_dir: Path) -> Any:
    config = replace(engine_config(tiny_llama_dir), enable_prompt_embeds=True)
    with serving(AsyncEngine(LLMEngine(config))) as running:
        yield running


def _client(server: RunningServer) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="unused", max_retries=0)


def test_rows_answer_as_their_text(server: RunningServer, rows: torch.Tensor) -> None:
    client = _client(server)
    greedy: dict[str, Any] = {"model": MODEL_NAME, "max_tokens": 8, "temperature": 0.0}
    by_text = client.completions.create(prompt=PROMPT, **greedy)
    other = client.completions.create(prompt=OTHER, **greedy)
    by_rows = client.completions.create(
        prompt=OTHER, extra_body={"prompt_embeds": [as_base64(rows), as_base64(rows)]}, **greedy
    )
    texts = [choice.text for choice in by_rows.choices]
    assert texts == [by_text.choices[0].text] * 2 + [other.choices[0].text]
    assert by_rows.usage is not None
    assert by_rows.usage.prompt_tokens == 2 * len(rows) + other.usage.prompt_tokens  # type: ignore[union-attr]
    # Alone (an empty `prompt`, as vLLM's example sends it), streamed.
    stream = client.completions.create(
        prompt="", stream=True, extra_body={"prompt_embeds": as_base64(rows)}, **greedy
    )
    assert "".join(chunk.choices[0].text for chunk in stream) == by_text.choices[0].text


def test_bad_rows_are_a_400_naming_the_field(server: RunningServer, rows: torch.Tensor) -> None:
    client = _client(server)
    hidden = rows.shape[1]
    refused = {
        "prompt_embeds": ["not base64!", as_base64({"rows": rows}), as_base64(torch.ones(3, 5)),
                          as_base64(torch.full((2, hidden), float("inf")))],
        "echo": [{"echo": True}],
        "suffix": [{"suffix": "after"}],
    }  # fmt: skip
    for field, cases in refused.items():
        for case in cases:
            body = case if isinstance(case, dict) else {}
            given = as_base64(rows) if isinstance(case, dict) else case
            with pytest.raises(openai.BadRequestError) as error:
                client.completions.create(
                    model=MODEL_NAME,
                    prompt="",
                    max_tokens=2,
                    extra_body={"prompt_embeds": given, **body},
                )
            assert error.value.body["param"] == field, error.value.body  # type: ignore[index]
    # A chat takes no rows: refused, not ignored.
    with pytest.raises(openai.BadRequestError) as error:
        client.chat.completions.create(
            model=MODEL_NAME,
            messages=[{"role": "user", "content": "hi"}],
            max_tokens=2,
            extra_body={"prompt_embeds": as_base64(rows)},
        )
    assert error.value.body["param"] == "prompt_embeds"  # type: ignore[index]
    assert server.engine.scheduler.kv_cache_stats().num_used_blocks == 0


def test_without_the_flag_rows_are_refused(tiny_llama_dir: Path, rows: torch.Tensor) -> None:
    refused = pytest.raises(openai.BadRequestError, match="--enable-prompt-embeds")
    with running_server(tiny_llama_dir) as server, refused as error:
        _client(server).completions.create(
            model=MODEL_NAME, prompt="", max_tokens=2, extra_body={"prompt_embeds": as_base64(rows)}
        )
    assert error.value.body["param"] == "prompt_embeds"  # type: ignore[index]
