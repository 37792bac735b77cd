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
from iterserve.sampling_params import InvalidRequestError
from iterserve.server.conversation_store import ConversationStore
from iterserve.server.errors import APIError
from iterserve.server.response_store import ResponseStore, StoredResponse
from iterserve.server.responses_protocol import ResponsesRequest, listed_item


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


async def conversation_history(
    body: ResponsesRequest, conversations: ConversationStore
) -> list[dict[str, Any]] | None:
    """The items of the conversation `body` names, oldest first (None: it names none); a 404
    if there is no such conversation."""
    conversation_id = body.conversation_id
    if conversation_id is None:
        return None
    if body.previous_response_id is not None:
        raise InvalidRequestError(
            "conversation and previous_response_id cannot both be given: a response continues "
            "one or the other",
            "conversation",
        )
    items = await conversations.items(conversation_id)
    if items is None:
        raise APIError(404, f"Conversation with id '{conversation_id}' not found.", "conversation")
    return items


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
        conversation=[*history, *(listed_item(item) for item in body.input_items())],
        token_ids=[*output.prompt_token_ids, *output.token_ids],
    )
