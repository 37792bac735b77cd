"""Every failure as an OpenAI-shaped error: {"error": {"message", "type", "param", "code"}};
under Anthropic's /v1/messages, Anthropic's shape: {"type": "error", "error": {"type",
"message"}} (with the same `param` beside them); under Ollama's /api, Ollama's:
{"error": "message"} (the message names the field).

Both APIs' clients turn these into typed exceptions (BadRequestError, ...), so a
user reads the message, not a stack trace. What the user sent wrong is a 4xx
with a message a person understands; only the server's own faults are 5xx.
"""

from __future__ import annotations

import json
import logging
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from iterserve.engine.async_engine import (
    EngineOverloadedError,
    EngineStoppedError,
    RequestFailedError,
)
from iterserve.engine.request_stream import ReplicaLostError
from iterserve.sampling_params import InvalidRequestError
from iterserve.server.error_paths import is_union_member

logger = logging.getLogger("iterserve.server")

_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    404: "invalid_request_error",  # as OpenAI answers an unknown model, id or URL
    405: "invalid_request_error",
    429: "rate_limit_error",
    499: "client_closed_request",
    503: "service_unavailable",
}


# Anthropic's error types, by status (anything else 5xx: api_error).
_ANTHROPIC_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    405: "invalid_request_error",
    413: "request_too_large",
    429: "rate_limit_error",
    503: "overloaded_error",
}
# The paths whose errors are Anthropic's shape, and Ollama's.
ANTHROPIC_PREFIX = "/v1/messages"
OLLAMA_PREFIX = "/api/"


class APIError(Exception):
    def __init__(
        self,
        status: int,
        message: str,
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.headers = headers


def error_body(
    status: int, message: str, param: str | None = None, code: str | None = None
) -> dict[str, Any]:
    return {
        "error": {
            "message": message,
            "type": _TYPES.get(
                status, "server_error" if status >= 500 else "invalid_request_error"
            ),
            "param": param,
            "code": code,
        }
    }


def anthropic_error_body(status: int, message: str, param: str | None = None) -> dict[str, Any]:
    kind = _ANTHROPIC_TYPES.get(status, "api_error" if status >= 500 else "invalid_request_error")
    return {"type": "error", "error": {"type": kind, "message": message, "param": param}}


def ollama_error_body(error: APIError) -> dict[str, Any]:
    """Ollama's shape: a message alone, so it names the field itself."""
    named = error.param is None or error.param in error.message
    return {"error": error.message if named else f"{error.param}: {error.message}"}


def as_api_error(error: Exception) -> APIError:
    """The HTTP face of an exception raised while serving a request."""
    if isinstance(error, APIError):
        return error
    if isinstance(error, InvalidRequestError):
        return APIError(400, str(error), error.param, error.code)
    if isinstance(error, EngineOverloadedError):
        retry = str(max(1, round(error.retry_after)))
        return APIError(429, str(error), code="rate_limit_exceeded", headers={"Retry-After": retry})
    if isinstance(error, EngineStoppedError):
        return APIError(503, str(error), code="service_unavailable")
    if isinstance(error, ReplicaLostError):  # not the request's fault: worth a retry
        retry = str(max(1, round(error.retry_after)))
        return APIError(503, str(error), code="replica_lost", headers={"Retry-After": retry})
    if isinstance(error, RequestFailedError):
        return APIError(500, str(error), code="engine_error")
    logger.exception("unexpected error while serving a request", exc_info=error)
    return APIError(500, "internal server error; the server log has the details")


def error_response(error: APIError, path: str = "") -> JSONResponse:
    """The error as JSON, in the shape of the API `path` belongs to."""
    body: dict[str, Any]
    if path.startswith(ANTHROPIC_PREFIX):
        body = anthropic_error_body(error.status, error.message, error.param)
    elif path.startswith(OLLAMA_PREFIX):
        body = ollama_error_body(error)
    else:
        body = error_body(error.status, error.message, error.param, error.code)
    return JSONResponse(body, status_code=error.status, headers=error.headers)


def _validation_message(error: RequestValidationError) -> tuple[str, str | None]:
    """The first problem pydantic found, said plainly, and the field it is about."""
    errors = error.errors()
    first = errors[0] if errors else {}
    kind = first.get("type", "")
    # loc is ("body", "field", ...) for body errors; drop the "body" prefix.
    loc = [str(part) for part in first.get("loc", ()) if part != "body"]
    branch = next((i for i, part in enumerate(loc) if is_union_member(part)), None)
    if branch is not None:  # a value that matched no member of a union (`stop`: str | list)
        field = ".".join(loc[:branch])
        forms = _union_branches(errors, first["loc"][: len(first["loc"]) - len(loc) + branch])
        # One error per member tried; a lone one is a dict key that looks like a type.
        if len(forms) > 1:
            return f"invalid value for '{field}': expected one of {', '.join(forms)}", field
    field = ".".join(loc) or None
    if kind == "json_invalid":
        detail = first.get("ctx", {}).get("error", "")
        return f"the request body is not valid JSON ({detail})".replace(" ()", ""), None
    if not loc:  # the body as a whole: absent, not an object, or not parsed as JSON at all
        if kind == "missing":
            return "the request body is empty; send a JSON object", None
        if isinstance(first.get("input"), str | bytes) and not _is_json(first["input"]):
            return "the request body is not valid JSON", None
        return (
            "the request body must be a JSON object, sent with Content-Type: application/json",
            None,
        )
    if kind == "missing":
        return f"the field '{field}' is required", field
    return f"invalid value for '{field}': {first.get('msg', 'invalid')}", field


def _union_branches(errors: list[Any], prefix: tuple[Any, ...]) -> list[str]:
    """The union members tried at `prefix`, in pydantic's order."""
    forms = [
        str(e["loc"][len(prefix)])
        for e in errors
        if tuple(e["loc"][: len(prefix)]) == prefix and len(e["loc"]) > len(prefix)
    ]
    return list(dict.fromkeys(forms))


def _is_json(text: str | bytes) -> bool:
    try:
        json.loads(text)
    except ValueError:
        return False
    return True


def install_error_handlers(app: FastAPI) -> None:
    async def on_validation(request: Request, error: RequestValidationError) -> JSONResponse:
        message, field = _validation_message(error)
        return error_response(APIError(400, message, field), request.url.path)

    async def on_http(request: Request, error: StarletteHTTPException) -> JSONResponse:
        message = str(error.detail)
        if error.status_code in (404, 405):  # the router's own: say what was asked for
            message = f"{message}: there is no {request.method} {request.url.path} on this server"
        return error_response(
            APIError(error.status_code, message, headers=error.headers), request.url.path
        )

    async def on_error(request: Request, error: Exception) -> JSONResponse:
        return error_response(as_api_error(error), request.url.path)

    app.add_exception_handler(RequestValidationError, on_validation)  # type: ignore[arg-type]
    app.add_exception_handler(StarletteHTTPException, on_http)  # type: ignore[arg-type]
    for kind in (
        APIError,
        InvalidRequestError,
        EngineOverloadedError,
        EngineStoppedError,
        RequestFailedError,
        Exception,  # anything else: still an OpenAI-shaped 500, never a bare traceback
    ):
        app.add_exception_handler(kind, on_error)
