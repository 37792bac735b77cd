"""POST /v1/rerank and /v1/score over a real socket: a reranker (a tiny
Qwen3ForSequenceClassification) against its own offline scores, ranking, top_n, documents
as objects, vLLM's other paths; the 400s naming their field; and an embedding server's
scores, the cosine of its embeddings."""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path

import httpx
import pytest
import torch

from embedding_checkpoints import save_embedding_qwen3
from iterserve.config import PoolingConfig
from iterserve.engine.async_engine import AsyncEngine
from iterserve.engine.llm import LLM
from iterserve.engine.llm_engine import LLMEngine
from iterserve.server.app import ServerSettings
from reranker_checkpoints import save_classifier
from server_fixtures import RunningServer, engine_config, serving

NAME = "tiny-reranker"
QUERY = "what do cats eat"
DOCUMENTS = [
    "The stock market closed higher on Tuesday.",
    "Cats are carnivores: they eat meat and fish.",
    "a",
    "Dogs and cats both like fish, " * 6,
]


@pytest.fixture(scope="module")
def reranker_dir(tmp_path_factory: pytest.TempPathFactory, tokenizer_dir: Path) -> Path:
    return save_classifier(tmp_path_factory.mktemp("reranker-server"), tokenizer_dir)


@pytest.fixture(scope="module")
def server(reranker_dir: Path) -> Iterator[RunningServer]:
    config = engine_config(reranker_dir, max_num_batched_tokens=32, max_num_seqs=8)
    with serving(
        AsyncEngine(LLMEngine(config)), ServerSettings(served_model_names=[NAME])
    ) as running:
        yield running


@pytest.fixture(scope="module")
def offline(reranker_dir: Path) -> list[float]:
    llm = LLM(
        str(reranker_dir), dtype="float32", compile=False, max_num_batched_tokens=32, max_num_seqs=8
    )
    return [out.score for out in llm.score(QUERY, DOCUMENTS, use_tqdm=False)]


def test_rerank_ranks_every_document_by_the_reranker(
    server: RunningServer, offline: list[float]
) -> None:
    body = httpx.post(
        f"{server.base_url}/v1/rerank",
        json={"model": NAME, "query": QUERY, "documents": DOCUMENTS},
        timeout=60,
    ).json()
    assert body["model"] == NAME and body["id"].startswith("rerank-")
    results = body["results"]
    assert [r["index"] for r in results] == sorted(range(4), key=lambda i: -offline[i])
    for result in results:
        assert result["relevance_score"] == pytest.approx(offline[result["index"]], abs=1e-6)
        assert result["document"] == {"text": DOCUMENTS[result["index"]]}
    assert body["usage"]["total_tokens"] == body["usage"]["prompt_tokens"] > 4 * 4


def test_rerank_top_n_objects_and_vllms_other_paths(
    server: RunningServer, offline: list[float]
) -> None:
    best = max(range(4), key=lambda i: offline[i])
    for path in ("/rerank", "/v2/rerank"):
        body = httpx.post(
            f"{server.base_url}{path}",
            json={
                "query": QUERY,
                "documents": [{"text": d} for d in DOCUMENTS],
                "top_n": 1,
                "return_documents": False,
            },
            timeout=60,
        ).json()
        assert [(r["index"], "document" in r) for r in body["results"]] == [(best, False)]


def test_rerank_in_teis_shape(server: RunningServer, offline: list[float]) -> None:
    """Hugging Face TEI's /rerank (as llama-server also takes it): `texts`, `return_text`,
    and the bare list of results, best first, each with a `score`."""
    body = httpx.post(
        f"{server.base_url}/rerank",
        json={"query": QUERY, "texts": DOCUMENTS, "return_text": True},
        timeout=60,
    ).json()
    assert [r["index"] for r in body] == sorted(range(4), key=lambda i: -offline[i])
    for rank in body:
        assert rank["score"] == pytest.approx(offline[rank["index"]], abs=1e-6)
        assert rank["text"] == DOCUMENTS[rank["index"]]
    bare = httpx.post(
        f"{server.base_url}/rerank", json={"query": QUERY, "texts": DOCUMENTS[:2]}, timeout=60
    ).json()
    assert all(set(rank) == {"index", "score"} for rank in bare)


def test_score_pairs_one_to_many_and_item_by_item(
    server: RunningServer, offline: list[float]
) -> None:
    for path in ("/v1/score", "/score"):
        body = httpx.post(
            f"{server.base_url}{path}", json={"text_1": QUERY, "text_2": DOCUMENTS}, timeout=60
        ).json()
        assert body["object"] == "list" and [d["index"] for d in body["data"]] == [0, 1, 2, 3]
        got = [d["score"] for d in body["data"]]
        assert got == pytest.approx(offline, abs=1e-6)
    body = httpx.post(
        f"{server.base_url}/v1/score",
        json={"text_1": [QUERY, QUERY], "text_2": DOCUMENTS[:2]},
        timeout=60,
    ).json()
    assert [d["score"] for d in body["data"]] == pytest.approx(offline[:2], abs=1e-6)


@pytest.mark.parametrize(
    "path, payload, field",
    [
        ("/v1/rerank", {"query": QUERY, "documents": []}, "documents"),
        ("/v1/rerank", {"query": QUERY}, "documents"),
        ("/v1/rerank", {"documents": ["a"]}, "query"),
        ("/v1/rerank", {"query": QUERY, "documents": ["a"], "top_n": -1}, "top_n"),
        ("/v1/rerank", {"query": QUERY, "documents": ["word " * 600]}, "documents"),
        ("/rerank", {"query": QUERY, "texts": []}, "texts"),
        ("/v1/rerank", {"query": "\ud800", "documents": ["a"]}, "query"),  # a lone surrogate
        ("/v1/rerank", {"query": "q", "documents": ["a", "\udfff"]}, "documents"),
        ("/rerank", {"query": QUERY, "texts": ["a"], "raw_scores": True}, "raw_scores"),
        ("/v1/score", {"text_1": ["a", "b"], "text_2": ["c", "d", "e"]}, "text_2"),
        ("/v1/score", {"text_1": [], "text_2": "c"}, "text_1"),
        ("/v1/rerank", {"model": "other", "query": "q", "documents": ["a"]}, "model"),
    ],
)
def test_bad_requests_name_their_field(
    server: RunningServer, path: str, payload: dict, field: str
) -> None:  # type: ignore[type-arg]
    # json.dumps escapes a lone surrogate ("\\ud800"): valid JSON that httpx's encoder refuses
    headers = {"Content-Type": "application/json"}
    url = f"{server.base_url}{path}"
    response = httpx.post(url, content=json.dumps(payload), headers=headers, timeout=60)
    assert response.status_code in (400, 404), response.text
    assert response.json()["error"]["param"] == field
    # The server goes on serving.
    ok = httpx.post(f"{server.base_url}/v1/score", json={"text_1": "q", "text_2": "d"}, timeout=60)
    assert ok.status_code == 200


def test_classify_gives_the_label_and_its_probability(
    server: RunningServer, reranker_dir: Path
) -> None:
    """vLLM's /classify on the one-label reranker: the label's probability is its sigmoid."""
    from transformers import AutoModelForSequenceClassification

    hf = AutoModelForSequenceClassification.from_pretrained(reranker_dir, dtype=torch.float32)
    body = httpx.post(
        f"{server.base_url}/classify", json={"model": NAME, "input": DOCUMENTS[:2]}, timeout=60
    ).json()
    assert body["object"] == "list" and body["usage"]["prompt_tokens"] > 0
    ids = httpx.post(
        f"{server.base_url}/tokenize", json={"prompt": DOCUMENTS[0]}, timeout=60
    ).json()["tokens"]
    with torch.no_grad():
        expected = torch.sigmoid(hf(torch.tensor([ids])).logits[0, 0])
    first = body["data"][0]
    assert first["label"] == "relevant" and first["num_classes"] == 1
    assert first["probs"] == pytest.approx([float(expected)], abs=1e-5)
    bad = httpx.post(f"{server.base_url}/v1/classify", json={"input": []}, timeout=60)
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "input"


def test_a_reranker_does_not_generate(server: RunningServer) -> None:
    response = httpx.post(
        f"{server.base_url}/v1/completions", json={"prompt": "hello", "max_tokens": 2}, timeout=60
    )
    assert response.status_code == 400 and response.json()["error"]["param"] == "model"


@pytest.mark.slow
def test_an_embedding_server_scores_by_cosine(tmp_path: Path, tokenizer_dir: Path) -> None:
    model_dir = save_embedding_qwen3(tmp_path / "st-qwen3", tokenizer_dir)
    config = replace(
        engine_config(model_dir, max_num_batched_tokens=32, max_num_seqs=8),
        pooling=PoolingConfig(task="both"),
    )
    with serving(AsyncEngine(LLMEngine(config)), ServerSettings()) as running:
        base = running.base_url
        scores = httpx.post(
            f"{base}/v1/score", json={"text_1": QUERY, "text_2": DOCUMENTS[:2]}, timeout=60
        ).json()["data"]
        vectors = httpx.post(
            f"{base}/v1/embeddings", json={"input": [QUERY, *DOCUMENTS[:2]]}, timeout=60
        ).json()["data"]
        q, *docs = (torch.tensor(v["embedding"]) for v in vectors)
        for data, doc in zip(scores, docs, strict=True):
            assert data["score"] == pytest.approx(float(torch.dot(q, doc)), abs=1e-5)
        ranked = httpx.post(
            f"{base}/v1/rerank", json={"query": QUERY, "documents": DOCUMENTS[:2]}, timeout=60
        ).json()["results"]
        assert {r["index"]: r["relevance_score"] for r in ranked} == pytest.approx(
            {d["index"]: d["score"] for d in scores}, abs=1e-6
        )
