"""POST /v1/embeddings over a real socket with the official `openai` client: texts, token
ids, base64, dimensions, the 400s naming their field, the API key, metrics, and chat
streaming from the same server meanwhile. One server: a tiny Qwen3 with
sentence-transformers' files (last token, normalized, matryoshka), serving both tasks."""

from __future__ import annotations

import base64
import struct
import threading
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path

import httpx
import openai
import pytest
import torch

from embedding_checkpoints import MATRYOSHKA_DIMENSIONS, VOCAB, save_embedding_qwen3
from iterserve.config import PoolingConfig
from iterserve.engine.async_engine import AsyncEngine
from iterserve.engine.llm_engine import LLMEngine
from iterserve.server.app import ServerSettings
from server_fixtures import RunningServer, engine_config, serving

KEY = "embed-key"
NAME = "tiny-qwen3-embed"
TEXTS = ["hello world", "the quick brown fox jumps over the lazy dog " * 10, "a"]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory, tokenizer_dir: Path) -> Path:
    return save_embedding_qwen3(tmp_path_factory.mktemp("st-qwen3-server"), tokenizer_dir)


@pytest.fixture(scope="module")
def server(model_dir: Path) -> Iterator[RunningServer]:
    config = replace(
        engine_config(model_dir, max_num_batched_tokens=32, max_num_seqs=8),
        pooling=PoolingConfig(task="both"),
    )
    settings = ServerSettings(served_model_names=[NAME], api_key=KEY)
    with serving(AsyncEngine(LLMEngine(config)), settings) as running:
        yield running


@pytest.fixture(scope="module")
def client(server: RunningServer) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.base_url}/v1", api_key=KEY, max_retries=0)


def reference(model_dir: Path, ids: list[int]) -> torch.Tensor:
    """transformers' final-norm state of the last token, normalized (what the
    sentence-transformers files ask for; test_embeddings.py checks sentence-transformers
    itself)."""
    from transformers import AutoModel

    model = AutoModel.from_pretrained(model_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        state = model(torch.tensor([ids])).last_hidden_state[0, -1]
    return torch.nn.functional.normalize(state, dim=0)


def post(server: RunningServer, body: object, key: str | None = KEY) -> httpx.Response:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    return httpx.post(f"{server.base_url}/v1/embeddings", json=body, headers=headers, timeout=60)


def test_texts_ids_base64_and_dimensions(
    server: RunningServer, client: openai.OpenAI, model_dir: Path
) -> None:
    tokenizer = server.engine.tokenizer
    ids = [tokenizer.encode(text) for text in TEXTS]
    expected = [reference(model_dir, i) for i in ids]
    one = client.embeddings.create(model=NAME, input=TEXTS[0], user="u-1")
    assert one.model == NAME and one.data[0].index == 0
    assert one.usage.prompt_tokens == one.usage.total_tokens == len(ids[0])
    torch.testing.assert_close(
        torch.tensor(one.data[0].embedding), expected[0], atol=1e-5, rtol=1e-5
    )
    for given in (TEXTS, ids):  # texts, and lists of ids (the long one is chunked: budget 32)
        many = client.embeddings.create(model=NAME, input=given)
        assert [d.index for d in many.data] == [0, 1, 2]
        assert many.usage.prompt_tokens == sum(map(len, ids))
        for data, want in zip(many.data, expected, strict=True):
            torch.testing.assert_close(torch.tensor(data.embedding), want, atol=1e-5, rtol=1e-5)
    flat = client.embeddings.create(model=NAME, input=ids[2])  # one list of ids
    torch.testing.assert_close(
        torch.tensor(flat.data[0].embedding), expected[2], atol=1e-5, rtol=1e-5
    )
    # The client asks for base64 unless told (and decodes it): the calls above. Asked for
    # floats, or for base64 explicitly (it then hands back the string: little-endian float32).
    floats = client.embeddings.create(model=NAME, input=TEXTS[0], encoding_format="float")
    torch.testing.assert_close(
        torch.tensor(floats.data[0].embedding), expected[0], atol=1e-5, rtol=1e-5
    )
    encoded = client.embeddings.create(model=NAME, input=TEXTS[0], encoding_format="base64")
    raw = base64.b64decode(encoded.data[0].embedding)  # type: ignore[arg-type]
    unpacked = struct.unpack(f"<{len(raw) // 4}f", raw)
    torch.testing.assert_close(torch.tensor(unpacked), expected[0], atol=1e-5, rtol=1e-5)
    # Matryoshka: the first numbers, normalized again.
    short = client.embeddings.create(
        model=NAME, input=TEXTS[1], dimensions=MATRYOSHKA_DIMENSIONS[0]
    )
    want = torch.nn.functional.normalize(expected[1][: MATRYOSHKA_DIMENSIONS[0]], dim=0)
    torch.testing.assert_close(torch.tensor(short.data[0].embedding), want, atol=1e-5, rtol=1e-5)


def test_truncate_prompt_tokens_embeds_a_long_input_by_its_end(
    server: RunningServer, client: openai.OpenAI, model_dir: Path
) -> None:
    """vLLM's truncate_prompt_tokens: an input past the 512-token context is embedded by
    its last 40 tokens (its first with truncation_side "right"), not refused."""
    ids = server.engine.tokenizer.encode("word " * 600)
    assert len(ids) > 512
    for side, kept in (("left", ids[-40:]), ("right", ids[:40])):
        cut = client.embeddings.create(
            model=NAME,
            input="word " * 600,
            extra_body={"truncate_prompt_tokens": 40, "truncation_side": side},
        )
        assert cut.usage.prompt_tokens == 40
        want = reference(model_dir, kept)
        torch.testing.assert_close(torch.tensor(cut.data[0].embedding), want, atol=1e-5, rtol=1e-5)
    whole = client.embeddings.create(
        model=NAME, input=ids, extra_body={"truncate_prompt_tokens": -1}
    )
    assert whole.usage.prompt_tokens == 512


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"input": ""}, "input"),
        ({"input": "x", "truncate_prompt_tokens": 0}, "truncate_prompt_tokens"),
        ({"input": "x", "truncate_prompt_tokens": 600}, "truncate_prompt_tokens"),
        ({"input": []}, "input"),
        ({"input": ["ok", ""]}, "input"),
        ({"input": [[]]}, "input"),
        ({"input": [VOCAB + 5]}, "input"),
        ({"input": "word " * 600}, "input"),  # past the 512-token context
        ({"input": 5}, "input"),
        ({"input": [{"text": "x"}]}, "input"),
        ({"input": "x", "encoding_format": "hex"}, "encoding_format"),
        ({"input": "x", "dimensions": 20}, "dimensions"),  # not a matryoshka size
    ],
)
def test_bad_input_is_a_400_naming_the_field(server: RunningServer, body: dict, param: str) -> None:
    response = post(server, body)
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == param, response.text


def test_an_unknown_model_is_openais_404(server: RunningServer) -> None:
    response = post(server, {"input": "x", "model": "other"})
    assert response.status_code == 404, response.text
    error = response.json()["error"]
    assert (error["param"], error["code"]) == ("model", "model_not_found"), response.text


def test_the_route_is_guarded_by_the_api_key(server: RunningServer) -> None:
    assert post(server, {"input": "x"}, key=None).status_code == 401
    assert post(server, {"input": "x"}, key="wrong").status_code == 401


def test_text_streams_while_embeddings_run_and_metrics_count_them(
    server: RunningServer, client: openai.OpenAI
) -> None:
    before = server.metrics().get("iterserve:embedding_requests_total", 0.0)
    results: list[int] = []

    def embed() -> None:
        for _ in range(3):
            results.append(len(client.embeddings.create(model=NAME, input=TEXTS).data))

    worker = threading.Thread(target=embed)
    worker.start()
    stream = client.completions.create(  # (the checkpoint has no chat template)
        model=NAME, prompt="hi", max_tokens=12, stream=True, extra_body={"ignore_eos": True}
    )
    chunks = [c for c in stream if c.choices]
    worker.join()
    assert len(chunks) == 12 and results == [3, 3, 3]
    metrics = server.metrics()
    assert metrics["iterserve:embedding_requests_total"] == before + 9
    assert metrics["iterserve:embedding_prompt_tokens_total"] > 0


def test_ollamas_embed_routes_give_the_same_vectors(
    server: RunningServer, client: openai.OpenAI, model_dir: Path
) -> None:
    """Ollama's /api/embed (and its first route, /api/embeddings) through the `ollama`
    client: the vectors /v1/embeddings gives; `truncate` (its default) embeds a long input
    by its start, and false refuses it; `dimensions` as Matryoshka's."""
    import ollama

    local = ollama.Client(host=server.base_url, headers={"Authorization": f"Bearer {KEY}"})
    expected = [
        torch.tensor(d.embedding) for d in client.embeddings.create(model=NAME, input=TEXTS).data
    ]
    embedded = local.embed(model=NAME, input=TEXTS)
    assert embedded.prompt_eval_count and len(embedded.embeddings) == len(TEXTS)
    for got, want in zip(embedded.embeddings, expected, strict=True):
        torch.testing.assert_close(torch.tensor(got), want, atol=1e-5, rtol=1e-5)
    one = local.embeddings(model=f"{NAME}:latest", prompt=TEXTS[0]).embedding
    torch.testing.assert_close(torch.tensor(one), expected[0], atol=1e-5, rtol=1e-5)
    short = local.embed(model=NAME, input=TEXTS[1], dimensions=MATRYOSHKA_DIMENSIONS[0])
    assert len(short.embeddings[0]) == MATRYOSHKA_DIMENSIONS[0]
    ids = server.engine.tokenizer.encode("word " * 600)
    cut = local.embed(model=NAME, input="word " * 600)
    assert cut.prompt_eval_count == 512
    want = reference(model_dir, ids[:512])
    torch.testing.assert_close(torch.tensor(cut.embeddings[0]), want, atol=1e-5, rtol=1e-5)
    with pytest.raises(ollama.ResponseError) as refused:
        local.embed(model=NAME, input="word " * 600, truncate=False)
    assert refused.value.status_code == 400 and "input" in refused.value.error
