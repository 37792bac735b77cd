"""A model's own sampling settings for the fields a request leaves unset (--generation-config
auto, as vLLM and llama.cpp take them): read from generation_config.json and from a GGUF's
general.sampling.* keys, used offline and by the server (the official client), while a
request's own value and --generation-config none keep theirs.

A tiny random model's next-token distribution is nearly flat, so a top_k of 1 is the one
setting whose effect shows in the text: the greedy answer, where sampling without it is not."""

from __future__ import annotations

import json
import logging
import shutil
from pathlib import Path

import openai
import pytest

from conftest import VOCAB
from iterserve import LLM
from iterserve.config import ConfigError, EngineConfig
from iterserve.model.tokenizer import load_hf_tokenizer
from iterserve.sampling_defaults import SamplingDefaults
from iterserve.sampling_params import SamplingParams
from server_fixtures import MODEL_NAME, running_server
from tiny_checkpoints import tiny_hf_model
from tiny_gguf import write_gguf

PROMPT = "The capital of France is"
SMALL = dict(dtype="float32", compile=False, num_kv_blocks=64)


def test_a_models_settings_are_read_and_unusable_ones_left_out(
    caplog: pytest.LogCaptureFixture,
) -> None:
    qwen3 = {"do_sample": True, "temperature": 0.6, "top_k": 20, "top_p": 0.95, "eos_token_id": 2}
    assert SamplingDefaults.from_generation_config(qwen3).given() == {
        "temperature": 0.6,
        "top_k": 20,
        "top_p": 0.95,
    }
    assert SamplingDefaults.from_generation_config(None) == SamplingDefaults()
    with caplog.at_level(logging.WARNING, logger="iterserve.sampling_defaults"):
        odd = {
            "temperature": -1.0,
            "top_p": 0.0,
            "top_k": 2.5,
            "min_p": True,
            "repetition_penalty": float("nan"),
        }
        assert SamplingDefaults.from_generation_config(odd) == SamplingDefaults()
    assert all(name in caplog.text for name in odd)
    gguf = {
        "general.sampling.temp": 0.7,
        "general.sampling.top_k": 40,
        "general.sampling.min_p": 0.05,
        "general.sampling.penalty_repeat": 1.3,  # written from repetition_penalty
        "general.sampling.mirostat": 2,  # llama.cpp's own samplers: not iterserve's
    }
    assert SamplingDefaults.from_gguf(gguf) == SamplingDefaults(
        temperature=0.7, top_k=40, min_p=0.05, repetition_penalty=1.3
    )


def test_a_ggufs_top_k_is_what_a_call_without_settings_samples_with(
    tmp_path: Path, tokenizer_dir: Path
) -> None:
    path = tmp_path / "tiny-top-k-1.gguf"
    hf = tiny_hf_model("llama", vocab_size=VOCAB, tie_word_embeddings=True)
    write_gguf(path, "llama", hf, load_hf_tokenizer(tokenizer_dir), sampling={"top_k": 1})
    llm = LLM(str(path), **SMALL)
    assert llm.get_default_sampling_params() == SamplingParams(top_k=1)
    greedy = llm.generate(PROMPT, SamplingParams(temperature=0.0), use_tqdm=False)[0].token_ids
    assert llm.generate(PROMPT, use_tqdm=False)[0].token_ids == greedy
    # The caller's own settings win: seeded sampling at temperature 1, no cut.
    sampled = llm.generate(PROMPT, SamplingParams(seed=0), use_tqdm=False)[0].token_ids
    assert sampled != greedy
    del llm
    plain = LLM(str(path), generation_config="none", **SMALL)
    assert plain.get_default_sampling_params() == SamplingParams()
    assert plain.generate(PROMPT, use_tqdm=False)[0].token_ids != greedy
    del plain
    # A user's settings go over the model's, field by field (vLLM's flag).
    over = LLM(str(path), override_generation_config={"temperature": 0.5}, **SMALL)
    assert over.get_default_sampling_params() == SamplingParams(top_k=1, temperature=0.5)


@pytest.mark.parametrize(
    "overrides, said",
    [
        ({"top_p": 0}, "top_p=0 is not a value a request could send"),
        ({"typical_p": 0.9}, "'typical_p' is not one of temperature, top_k"),
        ({"top_k": "20"}, "top_k='20' is not a value"),
        ({"max_new_tokens": 0}, "max_new_tokens=0 is not a value"),
        ({"max_tokens": 8}, "'max_tokens' is not one of"),  # generation_config.json's names
    ],
)
def test_overrides_a_request_could_not_send_stop_the_start(
    overrides: dict[str, object], said: str
) -> None:
    with pytest.raises(ConfigError, match="--override-generation-config") as raised:
        EngineConfig(override_generation_config=overrides)
    assert said in str(raised.value)


def _with_generation_config(model_dir: Path, tmp_path: Path, settings: dict[str, int]) -> Path:
    """A copy of the tiny HF checkpoint with `settings` as its generation_config.json."""
    model = tmp_path / "model"
    shutil.copytree(model_dir, model)
    (model / "generation_config.json").write_text(json.dumps(settings))
    return model


def test_the_server_fills_a_requests_unset_fields_from_generation_config_json(
    tiny_llama_dir: Path, tmp_path: Path
) -> None:
    model = _with_generation_config(tiny_llama_dir, tmp_path, {"top_k": 1, "eos_token_id": 2})
    with running_server(model) as server:
        client = openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="unused", max_retries=0)

        def text(**fields: object) -> str:
            answer = client.completions.create(
                model=MODEL_NAME,
                prompt=PROMPT,
                max_tokens=12,
                **fields,  # type: ignore[call-overload]
            )
            return answer.choices[0].text

        def chat(**fields: object) -> str | None:
            answer = client.chat.completions.create(
                model=MODEL_NAME,
                messages=[{"role": "user", "content": PROMPT}],
                max_tokens=12,
                **fields,  # type: ignore[call-overload]
            )
            return answer.choices[0].message.content

        assert text(seed=1) == text(temperature=0)  # top_k 1 from the model: greedy
        assert chat(seed=1) == chat(temperature=0)
        # A request's own top_k (0: no cut) is kept.
        assert text(seed=1, extra_body={"top_k": 0}) != text(temperature=0)
        assert chat(seed=1, extra_body={"top_k": 0}) != chat(temperature=0)


def test_max_new_tokens_limits_every_answer_and_a_folder_gives_another_generation_config(
    tmp_path: Path, tokenizer_dir: Path
) -> None:
    """vLLM's reading of generation_config.json's max_new_tokens: a limit on every answer (a
    request's own larger one, or none, is cut to it), not only a default; and its
    `--generation-config FOLDER`, another file than the checkpoint's."""
    limited = SamplingDefaults.from_generation_config({"max_new_tokens": 5, "max_length": 99})
    assert limited == SamplingDefaults(max_tokens=5)
    assert (limited.limit(3), limited.limit(2**31 - 1), SamplingDefaults().limit(7)) == (3, 5, 7)
    assert SamplingDefaults().with_overrides({"max_new_tokens": 4}).max_tokens == 4

    path = tmp_path / "tiny.gguf"  # no general.sampling keys of its own
    hf = tiny_hf_model("llama", vocab_size=VOCAB, tie_word_embeddings=True)
    write_gguf(path, "llama", hf, load_hf_tokenizer(tokenizer_dir))
    folder = tmp_path / "settings"
    folder.mkdir()
    (folder / "generation_config.json").write_text(json.dumps({"top_k": 1, "max_new_tokens": 3}))
    llm = LLM(str(path), generation_config=str(folder), **SMALL)
    assert llm.get_default_sampling_params() == SamplingParams(top_k=1, max_tokens=3)
    assert len(llm.generate(PROMPT, use_tqdm=False)[0].token_ids) <= 3
    del llm
    for given, said in [
        (tmp_path / "none-such", "is not auto, none, or a folder holding generation_config"),
        (tmp_path, "is not auto, none, or a folder holding generation_config"),
        (path, "cannot read"),  # a file, but not JSON
    ]:
        with pytest.raises(ConfigError, match="--generation-config") as raised:
            EngineConfig(generation_config=str(given))
        assert said in str(raised.value)


def test_the_servers_answers_stop_at_the_models_max_new_tokens(
    tiny_llama_dir: Path, tmp_path: Path
) -> None:
    model = _with_generation_config(tiny_llama_dir, tmp_path, {"max_new_tokens": 3})
    with running_server(model) as server:
        client = openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="unused", max_retries=0)
        for limit in (None, 10, 2):
            answer = client.completions.create(
                model=MODEL_NAME,
                prompt=PROMPT,
                max_tokens=limit,
                extra_body={"ignore_eos": True},
            )
            assert answer.usage is not None
            assert answer.usage.completion_tokens == min(limit or 3, 3)
            assert answer.choices[0].finish_reason == "length"
        chat = client.chat.completions.create(
            model=MODEL_NAME,
            messages=[{"role": "user", "content": PROMPT}],
            max_completion_tokens=10,
            extra_body={"ignore_eos": True},
        )
        assert chat.usage is not None and chat.usage.completion_tokens == 3
