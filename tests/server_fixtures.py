"""Helpers for the server tests: an engine on a tiny model, a real uvicorn
server on a free loopback port in a background thread, metrics scraping."""

from __future__ import annotations

import shutil
import socket
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import uvicorn

from iterserve.bench.server_process import scrape_metrics
from iterserve.config import CacheConfig, EngineConfig, SchedulerConfig
from iterserve.core.outputs import ModelOutput, SchedulerOutput
from iterserve.engine.async_engine import AsyncEngine
from iterserve.engine.llm_engine import LLMEngine
from iterserve.server.app import ServerSettings, create_app

MODEL_NAME = "tiny-llama"
# A tool-calling chat template (Qwen 2.5's), for tests of tools over a model without one.
QWEN_TOOLS_TEMPLATE = (
    Path(__file__).parent / "server" / "chat_templates" / "qwen2_5_tools.jinja"
).read_text()
# A text and two calls of a get_weather tool, as that template has the model write them.
TWO_WEATHER_CALLS = (
    "I'll check.\n<tool_call>\n"
    '{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n<tool_call>\n'
    '{"name": "get_weather", "arguments": {"city": "Lyon"}}\n</tool_call>'
)


def anthropic_prompt_tokens(message: Any) -> int:
    """An Anthropic message's prompt: its three input counts (uncached, read from the
    prefix cache, written to it) add up to it."""
    usage = message.usage
    return usage.input_tokens + usage.cache_read_input_tokens + usage.cache_creation_input_tokens


def answer_tokens(server: RunningServer, text: str) -> list[int]:
    """`text` as the model's tokens, then EOS: a script for `scripted_tokens`."""
    tokenizer = server.engine.tokenizer
    return tokenizer.encode(text, add_special_tokens=False) + [tokenizer.eos_token_id]


def with_chat_template(model_dir: Path, out: Path, template: str) -> Path:
    """A copy of the checkpoint in `model_dir` at `out`, with `template` as its chat template."""
    from iterserve.model.tokenizer import load_hf_tokenizer

    shutil.copytree(model_dir, out)
    tokenizer = load_hf_tokenizer(out)
    tokenizer.chat_template = template
    tokenizer.save_pretrained(out)
    return out


def engine_config(
    model_dir: Path, chat_template: str | None = None, cache_reuse: int = 0, **scheduler: Any
) -> EngineConfig:
    # fp32: the server's greedy text is compared with offline LLM.generate's.
    return EngineConfig(
        model=str(model_dir),
        chat_template=chat_template,
        dtype="float32",
        device="cpu",
        compile=False,  # compiling is tested on its own; here it would only cost time
        cache=CacheConfig(block_size=16, num_kv_blocks=512, cache_reuse=cache_reuse),
        scheduler=SchedulerConfig(**{"max_model_len": 512, **scheduler}),
    )


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@dataclass
class RunningServer:
    base_url: str
    async_engine: AsyncEngine
    server: uvicorn.Server

    @property
    def engine(self) -> LLMEngine:
        return self.async_engine.engine

    def metrics(self) -> dict[str, float]:
        """Every sample of /metrics as {'name{label="v",...}': value}."""
        return scrape_metrics(self.base_url)


@contextmanager
def running_server(
    model_dir: Path,
    settings: ServerSettings | None = None,
    max_waiting_requests: int = 256,
    chat_template: str | None = None,
    cache_reuse: int = 0,
    **scheduler: Any,
) -> Iterator[RunningServer]:
    """A server on the tiny model in `model_dir`; `chat_template` as --chat-template,
    `cache_reuse` as --cache-reuse."""
    engine = LLMEngine(engine_config(model_dir, chat_template, cache_reuse, **scheduler))
    async_engine = AsyncEngine(engine, max_waiting_requests=max_waiting_requests)
    with serving(async_engine, settings) as running:
        yield running


@contextmanager
def serving(
    async_engine: AsyncEngine, settings: ServerSettings | None = None
) -> Iterator[RunningServer]:
    """The app over `async_engine`, served by uvicorn on a free port in a thread."""
    settings = settings or ServerSettings(served_model_names=[MODEL_NAME])
    app = create_app(async_engine, settings)
    port = free_port()
    config = uvicorn.Config(
        app,
        host="127.0.0.1",
        port=port,
        log_level="warning",
        timeout_graceful_shutdown=10,
    )
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, name=f"uvicorn-{port}", daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        if not thread.is_alive() or time.monotonic() > deadline:
            raise RuntimeError("the test server did not start")
        time.sleep(0.02)
    try:
        yield RunningServer(f"http://127.0.0.1:{port}", async_engine, server)
    finally:
        server.should_exit = True
        thread.join(timeout=30)


def is_healthy(base_url: str) -> bool:
    """/health answers 200 (False while the port is not open yet)."""
    try:
        return httpx.get(f"{base_url}/health", timeout=1).status_code == 200
    except httpx.TransportError:
        return False


def wait_until(predicate: Any, timeout: float = 10.0, interval: float = 0.05) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(interval)
    return bool(predicate())


@contextmanager
def scripted_tokens(server: RunningServer, script: list[int]) -> Iterator[None]:
    """Every request samples `script` in order, whatever the model says."""
    executor = server.engine.executor
    original = executor.execute
    position: dict[str, int] = {}

    def execute(scheduled: SchedulerOutput) -> ModelOutput:
        output = original(scheduled)
        for request_id, tokens in output.sampled.items():
            for sampled in tokens:
                index = position.get(request_id, 0)
                position[request_id] = index + 1
                sampled.token_id = script[index % len(script)]
        return output

    executor.execute = execute  # type: ignore[method-assign]
    try:
        yield
    finally:
        executor.execute = original  # type: ignore[method-assign]


def reassembled(chunks: list[Any], index: int = 0) -> tuple[str, list[tuple[str, str]], str | None]:
    """Choice `index`'s content, calls (name, arguments) and finish reason in a stream, as
    a client builds them: a delta with an id opens a call, later ones add arguments."""
    content, calls, finish = "", {}, []
    for chunk in chunks:
        if not chunk.choices or chunk.choices[0].index != index:
            continue
        delta = chunk.choices[0].delta
        content += delta.content or ""
        for piece in delta.tool_calls or []:
            if piece.id is not None:
                assert piece.index not in calls and piece.function.name
                calls[piece.index] = [piece.function.name, ""]
            calls[piece.index][1] += piece.function.arguments or ""
        finish.append(chunk.choices[0].finish_reason)
    assert not any(finish[:-1])
    return content, [(name, args) for name, args in calls.values()], finish[-1]
