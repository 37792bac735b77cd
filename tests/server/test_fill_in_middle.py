"""Completions' `suffix`: a code model with fill-in-the-middle tokens (Qwen2.5-Coder's, on the
tiny model's tokenizer) is asked for what goes between the prompt and the suffix, in its
prefix-suffix-middle form, through a real server and the official client; a model without
such tokens, a token-id prompt and echo are refused naming `suffix`."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import httpx
import openai
import pytest

from conftest import VOCAB
from iterserve import LLM, SamplingParams
from iterserve.engine.fill_in_middle import KNOWN_FORMATS, fim_format
from iterserve.model.tokenizer import load_hf_tokenizer
from server_fixtures import MODEL_NAME, running_server
from tiny_checkpoints import save_checkpoint, tiny_hf_model

QWEN_CODER = KNOWN_FORMATS[0]
MARKERS = [QWEN_CODER.prefix, QWEN_CODER.suffix, QWEN_CODER.middle]
BEFORE = "def add(a, b):\n    "
AFTER = "\n\nprint(add(1, 2))\n"


@pytest.fixture(scope="module")
def coder_dir(tmp_path_factory: pytest.TempPathFactory, tokenizer_dir: Path) -> Path:
    tokenizer = load_hf_tokenizer(tokenizer_dir)
    tokenizer.add_special_tokens({"additional_special_tokens": MARKERS})  # type: ignore[dict-item]
    model = tiny_hf_model(
        "llama", vocab_size=VOCAB + 3, tie_word_embeddings=True, max_position_embeddings=512
    )
    return save_checkpoint(model, tmp_path_factory.mktemp("tiny-coder"), tokenizer)


def test_a_suffix_asks_a_code_model_for_the_middle(coder_dir: Path) -> None:
    fim_prompt = f"{QWEN_CODER.prefix}{BEFORE}{QWEN_CODER.suffix}{AFTER}{QWEN_CODER.middle}"
    llm = LLM(str(coder_dir), dtype="float32", compile=False, num_kv_blocks=64)
    # Its three markers, without Qwen's repository tokens (test_llama_server_api.py has them).
    assert fim_format(llm.tokenizer) == replace(QWEN_CODER, repository=None, file_separator=None)
    marker_ids = llm.tokenizer.convert_tokens_to_ids(MARKERS)
    expected = llm.generate(
        fim_prompt, SamplingParams(temperature=0.0, max_tokens=6), use_tqdm=False
    )[0]
    assert set(marker_ids) <= set(expected.prompt_token_ids)  # each marker one token
    del llm
    with running_server(coder_dir) as server:
        client = openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="unused", max_retries=0)
        answer = client.completions.create(
            model=MODEL_NAME, prompt=BEFORE, suffix=AFTER, max_tokens=6, temperature=0.0
        )
        assert answer.choices[0].text == expected.text
        assert answer.usage is not None
        assert answer.usage.prompt_tokens == len(expected.prompt_token_ids)
        # Streamed, and a batch of prompts: each its own middle before the same suffix.
        streamed = client.completions.create(
            model=MODEL_NAME, prompt=BEFORE, suffix=AFTER, max_tokens=6, temperature=0.0,
            stream=True,
        )  # fmt: skip
        assert "".join(chunk.choices[0].text for chunk in streamed) == expected.text
        two = client.completions.create(
            model=MODEL_NAME, prompt=[BEFORE, "x = "], suffix=AFTER, max_tokens=6,
            temperature=0.0,
        )  # fmt: skip
        assert two.choices[0].text == expected.text
        for refused in ({"prompt": [1, 2, 3]}, {"prompt": BEFORE, "echo": True}):
            reply = httpx.post(
                f"{server.base_url}/v1/completions",
                json={"suffix": AFTER, "max_tokens": 2, **refused},
            )
            assert reply.status_code == 400, reply.text
            assert reply.json()["error"]["param"] == "suffix"


def test_a_model_without_fill_in_the_middle_tokens_refuses_a_suffix(tiny_llama_dir: Path) -> None:
    with running_server(tiny_llama_dir) as server:
        reply = httpx.post(
            f"{server.base_url}/v1/completions",
            json={"prompt": BEFORE, "suffix": AFTER, "max_tokens": 2},
        )
        assert reply.status_code == 400, reply.text
        assert reply.json()["error"]["param"] == "suffix"
        assert "no fill-in-the-middle tokens" in reply.json()["error"]["message"]
        # An empty suffix is none, as before: a plain completion.
        plain = httpx.post(
            f"{server.base_url}/v1/completions",
            json={"prompt": BEFORE, "suffix": "", "max_tokens": 2},
        )
        assert plain.status_code == 200, plain.text
