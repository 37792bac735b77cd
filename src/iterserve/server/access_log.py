"""One structured (JSON) log line per HTTP request, written when its response ends.

A plain ASGI middleware rather than an `@app.middleware("http")` one: the
latter returns as soon as the headers go out, which for a stream is long
before the last token. Here the line is written when the body is complete or
the client has gone, with the tokens and TTFT the handler recorded.

It also tells the metrics which generation requests came in and how they were
answered, since it is the one place that sees every final status.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from iterserve.server.serving import ACCESS_RECORD_KEY, AccessRecord

logger = logging.getLogger("iterserve.access")

GENERATION_PATHS = ("/v1/completions", "/v1/chat/completions", "/v1/embeddings")
QUIET_PATHS = ("/health", "/metrics")


class AccessLogMiddleware:
    def __init__(self, app: ASGIApp, on_response: Callable[[str, int], None] | None = None) -> None:
        self.app = app
        self.on_response = on_response  # (path, status) for generation endpoints

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        start = time.monotonic()
        record = scope.setdefault(ACCESS_RECORD_KEY, AccessRecord(arrival=start))
        status = 500  # what the client sees if the app dies before answering
        complete = False

        async def logging_send(message: Message) -> None:
            nonlocal status, complete
            if message["type"] == "http.response.start":
                status = message["status"]
            elif message["type"] == "http.response.body" and not message.get("more_body"):
                complete = True
            await send(message)

        try:
            await self.app(scope, receive, logging_send)
        finally:
            path = scope.get("path", "")
            if not complete and status < 400:
                status = 499  # the client left before the response ended
            self._log(scope, record, status, time.monotonic() - start)
            if self.on_response is not None and path in GENERATION_PATHS:
                self.on_response(path, status)

    @staticmethod
    def _log(scope: Scope, record: AccessRecord, status: int, duration: float) -> None:
        # Probes and scrapes come every few seconds; at INFO they would drown the requests.
        level = logging.DEBUG if scope.get("path") in QUIET_PATHS else logging.INFO
        if not logger.isEnabledFor(level):
            return
        client = scope.get("client")
        line = {
            "request_id": record.request_id,
            "method": scope.get("method"),
            "path": scope.get("path"),
            "status": status,
            "client": f"{client[0]}:{client[1]}" if client else None,
            "prompt_tokens": record.prompt_tokens,
            "completion_tokens": record.completion_tokens,
            "ttft_ms": None if record.ttft is None else round(record.ttft * 1000, 1),
            "duration_ms": round(duration * 1000, 1),
            "finish_reasons": record.finish_reasons or None,
        }
        logger.log(level, json.dumps(line))
