"""A model named by its repository in the local Hugging Face cache, as `vllm serve OWNER/NAME`
and llama.cpp's `-hf OWNER/NAME:TAG` take one: loaded from the snapshot `hf download` left
(nothing downloaded), and served by that name. Resolution rules: tests/model/test_model_source.py."""

from __future__ import annotations

from pathlib import Path

import openai
import pytest
from huggingface_hub import constants

from conftest import VOCAB
from hub_cache import cache_repo
from iterserve import LLM
from iterserve.engine.async_engine import AsyncEngine
from iterserve.engine.llm_engine import LLMEngine
from iterserve.model.errors import ModelLoadError
from iterserve.model.tokenizer import load_hf_tokenizer
from iterserve.sampling_params import SamplingParams
from iterserve.server.app import ServerSettings
from server_fixtures import engine_config, serving
from tiny_checkpoints import tiny_hf_model
from tiny_gguf import write_gguf

PROMPT = "The capital of France is"
SMALL = dict(dtype="float32", compile=False, num_kv_blocks=64)


@pytest.fixture
def cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    root = tmp_path / "hub"
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(root))
    return root


def test_a_server_serves_an_hf_repository_by_its_name(cache: Path, tiny_llama_dir: Path) -> None:
    files = {p.name: p for p in tiny_llama_dir.iterdir() if p.is_file()}
    cache_repo(cache, "acme/tiny-llama", files)
    expected = LLM(str(tiny_llama_dir), **SMALL).generate(
        PROMPT, SamplingParams(temperature=0.0, max_tokens=4), use_tqdm=False
    )[0]
    engine = LLMEngine(engine_config(Path("acme/tiny-llama")))
    with serving(AsyncEngine(engine), ServerSettings()) as server:
        client = openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="unused", max_retries=0)
        assert [model.id for model in client.models.list()] == ["acme/tiny-llama"]
        answer = client.completions.create(
            model="acme/tiny-llama", prompt=PROMPT, max_tokens=4, temperature=0.0
        )
        assert answer.choices[0].text == expected.text


def test_a_tag_loads_that_quantization_of_a_gguf_repository(
    cache: Path, tmp_path: Path, tokenizer_dir: Path
) -> None:
    # Each file says which it is by its own sampling settings (general.sampling.top_k).
    hf = tiny_hf_model("llama", vocab_size=VOCAB, tie_word_embeddings=True)
    tokenizer = load_hf_tokenizer(tokenizer_dir)
    files = {}
    for name, top_k in [("tiny-F32.gguf", 3), ("tiny-Q8_0.gguf", 7)]:
        files[name] = tmp_path / name
        write_gguf(files[name], "llama", hf, tokenizer, sampling={"top_k": top_k})
    cache_repo(cache, "acme/tiny-GGUF", files)

    llm = LLM("acme/tiny-GGUF:q8_0", **SMALL)
    assert llm.get_default_sampling_params().top_k == 7
    assert llm.engine.model_name == "acme/tiny-GGUF:q8_0"
    greedy = SamplingParams(temperature=0.0, max_tokens=4)
    direct = LLM(str(files["tiny-Q8_0.gguf"]), **SMALL)
    assert (
        llm.generate(PROMPT, greedy, use_tqdm=False)[0].token_ids
        == direct.generate(PROMPT, greedy, use_tqdm=False)[0].token_ids
    )
    # Neither file is tagged Q4_K_M, llama.cpp's pick when no tag is given.
    with pytest.raises(ModelLoadError, match=r"no GGUF model tagged Q4_K_M \(it holds F32, Q8_0\)"):
        LLM("acme/tiny-GGUF", **SMALL)
