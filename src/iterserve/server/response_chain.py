"""A response chained to a stored one (`previous_response_id`), and a finished response
as it is stored (`store`).

A chained request reads the previous response's whole conversation (its input items,
history included, then its output items) before its own input. Its prompt starts with
the previous turn's tokens, prompt and answer, exactly as they ran when the rendering
begins with their text (`continuing`): the blocks that turn filled are then named by
the same hashes, and the prefix cache hands them back instead of computing them again.
"""

from __future__ import annotations

from typing import Any

from iterserve.engine.outputs import RequestOutput
from iterserve.server.errors import APIError
from iterserve.server.response_store import ResponseStore, StoredResponse
from iterserve.server.responses_protocol import ResponsesRequest, new_item_id


async def previous_response(body: ResponsesRequest, store: ResponseStore) -> StoredResponse | None:
    """The stored response `body` continues, if it names one (a 400 if it is not stored:
    OpenAI's status, code and message, which clients match on to resend the history)."""
    response_id = body.previous_response_id
    if response_id is None:
        return None
    previous = await store.get(response_id)
    if previous is None:
        raise APIError(
            400,
            f"Previous response with id '{response_id}' not found.",
            "previous_response_id",
            "previous_response_not_found",
        )
    return previous


def known_tokens(previous: StoredResponse | None) -> list[list[int]]:
    """Token sequences the new prompt may start with, longest first: the previous prompt
    and answer (the answer's text is rendered back as it was written), else the previous
    prompt alone (a template that rewrites answers, a stop string cut from the text)."""
    if previous is None:
        return []
    return [previous.token_ids, previous.token_ids[: previous.prompt_tokens]]


def stored_response(
    response: dict[str, Any],
    body: ResponsesRequest,
    previous: StoredResponse | None,
    output: RequestOutput,
) -> StoredResponse:
    history = previous.history if previous is not None else []
    return StoredResponse(
        id=response["id"],
        response=response,
        conversation=[*history, *(_with_id(item) for item in body.input_items())],
        token_ids=[*output.prompt_token_ids, *output.token_ids],
    )


_ITEM_ID_PREFIXES = {"function_call": "fc", "function_call_output": "fco"}


def _with_id(item: dict[str, Any]) -> dict[str, Any]:
    """An input item as GET .../input_items lists it: with an id, as every item has there."""
    if "id" in item:
        return item
    prefix = _ITEM_ID_PREFIXES.get(item.get("type", "message"), "msg")
    return {"id": new_item_id(prefix), **item}
