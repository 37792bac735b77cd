"""A serving process takes its startup heap out of the garbage collector's full passes
(engine/startup_heap.py); an engine built in a process that goes on to do other things
does not."""

from __future__ import annotations

import asyncio
import gc
import re
from pathlib import Path

import httpx
import pytest

from iterserve.bench.server_process import launch_server
from iterserve.engine.async_engine import AsyncEngine
from iterserve.engine.llm_engine import LLMEngine
from server_fixtures import engine_config, wait_until


@pytest.mark.slow
def test_iterserve_serve_freezes_its_startup_heap_once_warm(
    tiny_llama_dir: Path, tmp_path: Path
) -> None:
    log = tmp_path / "serve.log"
    config = engine_config(tiny_llama_dir)
    with launch_server(
        config, extra_args=["--log-level", "info"], log_path=log, startup_timeout=120
    ) as server:
        frozen = re.search(r"startup heap frozen: (\d+) objects", log.read_text())
        # Everything start-up made: torch, transformers, the model, the app (~10^5 objects).
        assert frozen and int(frozen[1]) > 50_000, server.log_tail()
        model = httpx.get(f"{server.base_url}/v1/models", timeout=10).json()["data"][0]["id"]
        body = {"model": model, "prompt": "Hello", "max_tokens": 4, "temperature": 0}
        response = httpx.post(f"{server.base_url}/v1/completions", json=body, timeout=30)
        assert response.status_code == 200
        assert response.json()["usage"]["completion_tokens"] == 4


def test_an_engine_launched_in_process_leaves_the_heap_to_the_collector(
    tiny_llama_dir: Path,
) -> None:
    """Tests and benchmarks build engines and drop them: a frozen cycle would never be freed."""
    frozen_before = gc.get_freeze_count()
    async_engine = AsyncEngine.launch(lambda: LLMEngine(engine_config(tiny_llama_dir)))
    try:
        assert wait_until(lambda: async_engine.is_ready, timeout=60)
        assert gc.get_freeze_count() == frozen_before
    finally:
        asyncio.run(async_engine.shutdown())
        async_engine.close()
