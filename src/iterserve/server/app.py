"""The FastAPI app: OpenAI routes under /v1, plus /tokenize, /detokenize, /health and
/metrics.

`create_app(AsyncEngine(LLMEngine(config)))` gives an ASGI app; its lifespan
starts the engine loop and, on shutdown, drains it. Any ServingEngine will do: a
DataParallelEngine puts a fleet of replicas behind the same routes.
"""

from __future__ import annotations

import hmac
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass, field

from fastapi import APIRouter, Depends, FastAPI, Request
from fastapi.responses import JSONResponse, Response

from iterserve.chat.tool_parsers import select_tool_parser
from iterserve.engine.serving_engine import REPLICA_OK, ServingEngine
from iterserve.server.access_log import AccessLogMiddleware
from iterserve.server.chat import create_chat_completion
from iterserve.server.completions import create_completion
from iterserve.server.errors import APIError, install_error_handlers
from iterserve.server.metrics import CONTENT_TYPE, ServerMetrics
from iterserve.server.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    ModelCard,
    ModelList,
    ResetPrefixCacheResponse,
)
from iterserve.server.serving import ServingContext
from iterserve.server.tokenize import tokenizer_routes

logger = logging.getLogger("iterserve.server")


@dataclass
class ServerSettings:
    served_model_names: list[str] = field(default_factory=list)  # empty: the engine's model name
    api_key: str | None = None
    # Seconds in-flight requests get to finish once shutdown starts.
    shutdown_timeout: float = 30.0
    tool_call_parser: str = "auto"  # a name in TOOL_PARSER_CHOICES


def _api_key_check(api_key: str | None) -> Callable[[Request], Awaitable[None]]:
    expected = f"Bearer {api_key}".encode()

    async def check(request: Request) -> None:
        if api_key is None:
            return
        given = request.headers.get("authorization", "").encode()
        if not hmac.compare_digest(given, expected):  # constant time: no timing oracle
            raise APIError(
                401,
                "missing or wrong API key: send it as 'Authorization: Bearer <key>'",
                code="invalid_api_key",
            )

    return check


def create_app(async_engine: ServingEngine, settings: ServerSettings | None = None) -> FastAPI:
    settings = settings or ServerSettings()
    model = async_engine.served_model
    ctx = ServingContext(
        engine=async_engine,
        served_model_names=settings.served_model_names or [model.name],
        tokenizer=model.tokenizer,
        chat_template=model.chat_template,
        max_model_len=model.max_model_len,
        tool_parser=select_tool_parser(settings.tool_call_parser, model.chat_template),
    )
    logger.info(
        "tool calls: %s (--tool-call-parser %s)",
        ctx.tool_parser.name if ctx.tool_parser else "not parsed",
        settings.tool_call_parser,
    )
    metrics = ServerMetrics(async_engine)
    async_engine.on_finished = metrics.observe_finished

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        async_engine.start()
        yield
        await async_engine.shutdown(settings.shutdown_timeout)

    app = FastAPI(title="iterserve", summary="OpenAI-compatible LLM server", lifespan=lifespan)
    app.state.serving = ctx
    app.state.metrics = metrics
    install_error_handlers(app)
    app.add_middleware(AccessLogMiddleware, on_response=metrics.observe_http)

    guarded = [Depends(_api_key_check(settings.api_key))]
    v1 = APIRouter(prefix="/v1", dependencies=guarded)

    @v1.get("/models")
    async def list_models() -> ModelList:
        return ModelList(
            data=[
                ModelCard(id=name, root=ctx.served_model_names[0], max_model_len=ctx.max_model_len)
                for name in ctx.served_model_names
            ]
        )

    @v1.post("/completions")
    async def completions(body: CompletionRequest, request: Request) -> Response:
        return await create_completion(body, request, ctx)

    @v1.post("/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, request: Request) -> Response:
        return await create_chat_completion(body, request, ctx)

    app.include_router(v1)

    # vLLM's path, outside /v1 but behind the same key: benchmarks call it between runs.
    admin = APIRouter(dependencies=guarded)

    @admin.post("/reset_prefix_cache")
    async def reset_prefix_cache() -> ResetPrefixCacheResponse:
        """Forget the prefix cache's blocks that no running request holds."""
        dropped = await async_engine.reset_prefix_cache()
        return ResetPrefixCacheResponse(num_blocks_dropped=dropped)

    app.include_router(admin)
    # vLLM's paths, outside /v1 too.
    app.include_router(tokenizer_routes(ctx), dependencies=guarded)

    @app.get("/health")
    async def health() -> Response:
        # 503 while warming up (compiling) and while draining too, so a load balancer sends
        # nothing before we are fast, and stops sending before we stop. A fleet that lost
        # replicas but still has one serving says "degraded" with a 200: it does serve.
        replicas = async_engine.replica_health()
        extra: dict[str, object] = {"replicas": replicas} if replicas else {}
        if compute := async_engine.served_model.compute:
            extra["model"] = compute  # which dtype, kernels and ISA serve, and why
        if async_engine.is_accepting and async_engine.is_ready:
            degraded = any(state != REPLICA_OK for state in replicas)
            return JSONResponse({"status": "degraded" if degraded else "ok", **extra})
        if not async_engine.is_healthy:
            status = "dead"
        elif not async_engine.is_ready:
            status = "warming up"
        else:
            status = "draining"
        return JSONResponse({"status": status, **extra}, status_code=503)

    @app.get("/metrics")
    async def prometheus_metrics() -> Response:
        return Response(metrics.render(), media_type=CONTENT_TYPE)

    return app
