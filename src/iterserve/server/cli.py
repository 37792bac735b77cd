"""`iterserve serve`: load the model, start the engine loop, serve the OpenAI API."""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import socket
from types import FrameType
from typing import Any

from iterserve.config import add_engine_args, engine_config_from_args

logger = logging.getLogger("iterserve.server")


def add_subcommands(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "serve",
        help="serve a model over the OpenAI API (/v1/completions, /v1/chat/completions)",
        description="Serve a model over the OpenAI API, with /health and /metrics.",
    )
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default: loopback only)")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument(
        "--api-key",
        default=None,
        help="require 'Authorization: Bearer KEY' on /v1 routes (default: $ITERSERVE_API_KEY)",
    )
    p.add_argument(
        "--served-model-name",
        nargs="+",
        default=None,
        help="name(s) clients use for the model (default: the model's own name)",
    )
    p.add_argument(
        "--max-waiting-requests",
        type=int,
        default=256,
        help="requests that may wait for a slot; beyond it, 429 with Retry-After",
    )
    p.add_argument(
        "--shutdown-timeout",
        type=float,
        default=30.0,
        help="seconds in-flight requests get to finish after SIGTERM",
    )
    p.add_argument(
        "--log-level", default="info", choices=("critical", "error", "warning", "info", "debug")
    )
    add_engine_args(p)
    p.set_defaults(func=serve)


def serve(args: argparse.Namespace) -> int:
    # Deferred: torch and the web stack load only for this subcommand.
    import uvicorn

    from iterserve.engine.async_engine import AsyncEngine
    from iterserve.engine.llm_engine import LLMEngine
    from iterserve.server.app import ServerSettings, create_app

    logging.basicConfig(
        level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    config = engine_config_from_args(args)
    # Built and warmed up on the engine's own thread (see AsyncEngine.launch); the port
    # opens once the weights are in, and /health says "warming up" until compiling is done.
    async_engine = AsyncEngine.launch(
        lambda: LLMEngine(config, warm_up=False), max_waiting_requests=args.max_waiting_requests
    )
    engine = async_engine.engine
    settings = ServerSettings(
        served_model_names=args.served_model_name or [],
        api_key=args.api_key or os.environ.get("ITERSERVE_API_KEY") or None,
        # uvicorn already gave in-flight requests the full timeout before the app's
        # shutdown runs; what is left then is only a backstop.
        shutdown_timeout=min(5.0, args.shutdown_timeout),
    )
    app = create_app(async_engine, settings)

    class Server(uvicorn.Server):
        def handle_exit(self, sig: int, frame: FrameType | None) -> None:
            # Refuse new work (and fail /health) from the signal on, not only
            # once uvicorn has waited for open connections.
            async_engine.stop_accepting()
            super().handle_exit(sig, frame)

        async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
            await super().shutdown(sockets)  # ends with the app's: the engine loop stops
            # Here rather than after run(): uvicorn re-raises the signal that stopped it
            # once run() is done, and the default SIGTERM handler would end this process
            # with the tensor-parallel workers never told to stop.
            await asyncio.to_thread(engine.close)

    uvicorn_config: dict[str, Any] = {
        "host": args.host,
        "port": args.port,
        "log_level": args.log_level,
        "access_log": False,  # iterserve.access writes one richer line per request
        "timeout_graceful_shutdown": args.shutdown_timeout,
    }
    logger.info(
        "serving %s on http://%s:%d/v1", settings.served_model_names or engine.model_name,
        args.host, args.port,
    )  # fmt: skip
    Server(uvicorn.Config(app, **uvicorn_config)).run()
    return 0
