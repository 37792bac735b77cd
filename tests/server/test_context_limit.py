"""Through the real server with the default KV settings (--kv-cache-memory auto, no
--max-model-len): the context limit is the model's, or the pool's when that is smaller, and
/v1/models reports it; a request past it is a 400 naming the field and the limit."""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest

from iterserve.config import CacheConfig, EngineConfig
from iterserve.engine.async_engine import AsyncEngine
from iterserve.engine.llm_engine import LLMEngine
from server_fixtures import RunningServer, serving

pytestmark = pytest.mark.timeout(180)


def default_config(model_dir: Path, cache: CacheConfig) -> EngineConfig:
    return EngineConfig(model=str(model_dir), dtype="float32", compile=False, cache=cache)


def refusal(server: RunningServer, prompt_tokens: int, max_tokens: int) -> dict[str, str]:
    response = httpx.post(
        f"{server.base_url}/v1/completions",
        json={"prompt": [7] * prompt_tokens, "max_tokens": max_tokens},
    )
    assert response.status_code == 400, response.text
    return response.json()["error"]


def test_the_model_s_context_is_the_limit_with_the_defaults(tiny_llama_dir: Path) -> None:
    engine = LLMEngine(default_config(tiny_llama_dir, CacheConfig()))
    with serving(AsyncEngine(engine)) as server:
        models = httpx.get(f"{server.base_url}/v1/models").json()["data"]
        assert models[0]["max_model_len"] == 512  # the tiny model's max_position_embeddings
        error = refusal(server, 500, 13)
        assert (
            error["param"] == "max_tokens"
            and "maximum context length is 512 tokens" in error["message"]
        )
        error = refusal(server, 600, 1)
        assert (
            error["param"] == "prompt"
            and "maximum context length is 512 tokens" in error["message"]
        )
        health = httpx.get(f"{server.base_url}/health").json()["model"]
        assert health["kv_cache_rule"] == "auto" and int(health["kv_cache_available_bytes"]) > 0
        assert int(health["kv_cache_blocks"]) == engine.scheduler.kv_cache_stats().num_blocks
        answer = httpx.post(
            f"{server.base_url}/v1/completions", json={"prompt": [7] * 500, "max_tokens": 12}
        )
        assert answer.status_code == 200, answer.text


def test_a_pool_smaller_than_the_context_is_the_limit(tiny_llama_dir: Path) -> None:
    engine = LLMEngine(default_config(tiny_llama_dir, CacheConfig(num_kv_blocks=8)))
    with serving(AsyncEngine(engine)) as server:
        models = httpx.get(f"{server.base_url}/v1/models").json()["data"]
        assert models[0]["max_model_len"] == 8 * 16
        error = refusal(server, 100, 50)
        assert (
            error["param"] == "max_tokens"
            and "maximum context length is 128 tokens" in error["message"]
        )
