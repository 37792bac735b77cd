"""The lines of a batch file, OpenAI's Batch API format (what vLLM's `run-batch` reads and
writes): each input line one request, `{"custom_id", "method": "POST", "url", "body"}`;
each output line its answer, `{"id", "custom_id", "response": {"status_code", "request_id",
"body"}, "error"}`. A request the server answered, 4xx included, has a `response` (its body
the error, as the API gives it); a line that could not be sent at all (not JSON, an unknown
url, a custom_id seen before, a stream) has `error` instead, as OpenAI reports such lines. Either way
every input line gets its output line, matched by `custom_id` (output lines come in the
order the answers finish, as OpenAI's may)."""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass
from typing import Any

# The endpoints a batch line may name: OpenAI's batch endpoints that this server serves, and
# vLLM's scoring ones, as its run-batch takes them.
BATCH_URLS = (
    "/v1/chat/completions",
    "/v1/completions",
    "/v1/embeddings",
    "/v1/responses",
    "/v1/score",
    "/v1/rerank",
)


@dataclass(frozen=True)
class BatchLine:
    """One input line: the request to send, or why it cannot be sent (`problem`)."""

    number: int  # from 1, as an editor counts
    custom_id: str | None
    url: str = ""
    body: dict[str, Any] | None = None
    problem: str | None = None


def parse_line(number: int, text: str, seen: set[str]) -> BatchLine:
    """Line `number` of the input (blank lines are the caller's to skip); `seen`: the
    custom_ids of the lines before, which this one's joins."""
    try:
        line = json.loads(text)
    except json.JSONDecodeError as error:
        return BatchLine(number, None, problem=f"line {number} is not JSON: {error}")
    if not isinstance(line, dict):
        return BatchLine(number, None, problem=f"line {number} is not a JSON object")
    custom_id = line.get("custom_id")
    if not isinstance(custom_id, str) or not custom_id:
        return BatchLine(number, None, problem=f"line {number}: custom_id must be a string")
    if custom_id in seen:
        return BatchLine(number, custom_id, problem=f"custom_id {custom_id!r} is not unique")
    seen.add(custom_id)
    method, url, body = line.get("method", "POST"), line.get("url"), line.get("body")
    if method != "POST":
        return BatchLine(number, custom_id, problem=f"method must be POST, got {method!r}")
    if url not in BATCH_URLS:
        return BatchLine(
            number, custom_id, problem=f"url must be one of {', '.join(BATCH_URLS)}, got {url!r}"
        )
    if not isinstance(body, dict):
        return BatchLine(number, custom_id, problem="body must be a JSON object")
    if body.get("stream"):
        return BatchLine(
            number, custom_id, problem="stream must be false: a batch's answers are whole"
        )
    return BatchLine(number, custom_id, url, body)


def answered(line: BatchLine, status: int, body: Any) -> dict[str, Any]:
    """The output line of a request the server answered (`body`: its JSON)."""
    request_id = body.get("id") if isinstance(body, dict) else None
    return {
        "id": f"batch_req_{uuid.uuid4().hex}",
        "custom_id": line.custom_id,
        "response": {
            "status_code": status,
            "request_id": request_id or f"req_{uuid.uuid4().hex}",
            "body": body,
        },
        "error": None,
    }


def not_sent(line: BatchLine) -> dict[str, Any]:
    """The output line of a line that could not be sent (`line.problem`)."""
    return {
        "id": f"batch_req_{uuid.uuid4().hex}",
        "custom_id": line.custom_id,
        "response": None,
        "error": {"code": "invalid_batch_line", "message": line.problem, "line": line.number},
    }
