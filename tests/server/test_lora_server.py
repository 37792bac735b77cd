"""LoRA adapters over a real server and the official openai client: a request's `model` picks
its adapter, /v1/models lists adapters under their base, adapters load and unload at run time
while another request streams, bad adapters get a 4xx naming the field, and the metrics count
per adapter."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path

import httpx
import openai
import pytest

from iterserve.config import LoRAConfig
from iterserve.engine.async_engine import AsyncEngine
from iterserve.engine.llm_engine import LLMEngine
from iterserve.server.app import ServerSettings
from lora_adapters import peft_greedy
from server_fixtures import MODEL_NAME, RunningServer, engine_config, serving
from tiny_checkpoints import tiny_hf_model

pytestmark = [pytest.mark.timeout(180), pytest.mark.slow]

KEY = "sk-test"
STREAMED = 300  # tokens of the request that streams while adapters come and go
PROMPT = [1, 450, 7483, 310, 3444, 338, 263, 2107, 4272, 297]


@pytest.fixture(scope="module")
def server(tiny_llama_dir: Path, tiny_llama_adapters: dict[str, Path]) -> Iterator[RunningServer]:
    lora = LoRAConfig(
        lora_modules=[f"attn={tiny_llama_adapters['attn']}"], max_loras=2, max_lora_rank=8
    )
    engine = LLMEngine(replace(engine_config(tiny_llama_dir), lora=lora))
    settings = ServerSettings(served_model_names=[MODEL_NAME], api_key=KEY)
    with serving(AsyncEngine(engine), settings) as running:
        yield running


@pytest.fixture(scope="module")
def client(server: RunningServer) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.base_url}/v1", api_key=KEY, max_retries=0)


def _post(server: RunningServer, path: str, body: dict, key: str = KEY) -> httpx.Response:
    headers = {"Authorization": f"Bearer {key}"}
    return httpx.post(f"{server.base_url}/v1/{path}", json=body, headers=headers, timeout=30)


def _complete(client: openai.OpenAI, model: str, max_tokens: int = 8) -> str:
    out = client.completions.create(
        model=model, prompt=PROMPT, max_tokens=max_tokens, temperature=0
    )
    return out.choices[0].text


def test_the_model_name_picks_the_adapter(
    client: openai.OpenAI, server: RunningServer, tiny_llama_dir: Path, tiny_llama_adapters: dict
) -> None:
    models = {m.id: m for m in client.models.list().data}
    assert set(models) == {MODEL_NAME, "attn"}
    assert models["attn"].model_extra["parent"] == MODEL_NAME
    ((tokens, _),) = peft_greedy(tiny_llama_dir, tiny_llama_adapters["attn"], [PROMPT], 8)
    assert _complete(client, "attn") == server.engine.tokenizer.decode(tokens)
    assert _complete(client, MODEL_NAME) != _complete(client, "attn")
    chat = client.chat.completions.create(
        model="attn", messages=[{"role": "user", "content": "Hi"}], max_tokens=4
    )
    assert chat.model == "attn" and chat.usage.completion_tokens == 4
    with pytest.raises(openai.NotFoundError) as error:
        _complete(client, "nobody")
    assert error.value.body["code"] == "model_not_found" and error.value.body["param"] == "model"
    # Embeddings and cosine scores too run the adapter the name picks.
    vectors = {
        name: client.embeddings.create(model=name, input=PROMPT).data[0].embedding
        for name in (MODEL_NAME, "attn")
    }
    assert vectors[MODEL_NAME] != vectors["attn"]
    assert vectors["attn"] == client.embeddings.create(model="attn", input=PROMPT).data[0].embedding
    scores = {
        name: _post(server, "score", {"model": name, "text_1": "a", "text_2": "b"}).json()
        for name in (MODEL_NAME, "attn")
    }
    assert scores["attn"]["model"] == "attn"
    assert scores["attn"]["data"][0]["score"] != scores[MODEL_NAME]["data"][0]["score"]


def test_load_and_unload_while_another_request_streams(
    client: openai.OpenAI, server: RunningServer, tiny_llama_adapters: dict
) -> None:
    chunks: list[str] = []
    started = threading.Event()

    def stream() -> None:
        for chunk in client.completions.create(
            model="attn", prompt=PROMPT, max_tokens=STREAMED, temperature=0, stream=True
        ):
            chunks.append(chunk.choices[0].text)
            started.set()

    streaming = threading.Thread(target=stream)
    streaming.start()
    assert started.wait(30)
    response = _post(
        server,
        "load_lora_adapter",
        {"lora_name": "mlp", "lora_path": str(tiny_llama_adapters["mlp"])},
    )
    assert response.status_code == 200, response.text
    assert len(chunks) < STREAMED, "the stream ended before the adapter was loaded"
    assert "mlp" in {m.id for m in client.models.list().data}
    loaded = _complete(client, "mlp")
    assert _post(server, "unload_lora_adapter", {"lora_name": "mlp"}).status_code == 200
    with pytest.raises(openai.NotFoundError):
        _complete(client, "mlp")
    # Loaded again under another name: a new id, the same text (no stale slot or KV).
    again = {"lora_name": "mlp2", "lora_path": str(tiny_llama_adapters["mlp"])}
    assert _post(server, "load_lora_adapter", again).status_code == 200
    assert _complete(client, "mlp2") == loaded
    streaming.join(60)
    assert len(chunks) == STREAMED and not streaming.is_alive()
    metrics = server.metrics()
    assert metrics['iterserve:lora_requests_total{adapter="mlp"}'] == 1
    assert metrics['iterserve:lora_generation_tokens_total{adapter="attn"}'] >= STREAMED
    assert metrics["iterserve:lora_resident_adapters"] == 2


def test_bad_adapters_get_a_4xx_naming_the_field(
    server: RunningServer, tiny_llama_adapters: dict, tmp_path: Path
) -> None:
    other = tiny_hf_model("llama", vocab_size=256, intermediate_size=96)
    other.save_pretrained(tmp_path / "other")
    from lora_adapters import SPECS, make_adapter

    wrong_base = make_adapter(tmp_path / "other", tmp_path / "wrong", SPECS[1], 0)
    cases = [
        ({"lora_name": "rs", "lora_path": str(tiny_llama_adapters["rs"])}, 400, "lora_path"),
        ({"lora_name": "w", "lora_path": str(wrong_base)}, 400, "lora_path"),
        ({"lora_name": "x", "lora_path": str(tmp_path / "none")}, 400, "lora_path"),
        ({"lora_name": "attn", "lora_path": str(tiny_llama_adapters["mlp"])}, 400, "lora_name"),
        ({"lora_name": "x"}, 400, "lora_path"),
    ]
    for body, status, field in cases:
        response = _post(server, "load_lora_adapter", body)
        assert response.status_code == status, (body, response.text)
        error = response.json()["error"]
        assert error["param"] == field, error
        assert (
            field == "lora_name"
            or "rank" in error["message"]
            or "another base" in error["message"]
            or "does not exist" in error["message"]
            or "required" in error["message"]
        ), error
    assert _post(server, "unload_lora_adapter", {"lora_name": "nobody"}).status_code == 404
    unauthorized = _post(server, "load_lora_adapter", cases[0][0], key="wrong")
    assert unauthorized.status_code == 401
