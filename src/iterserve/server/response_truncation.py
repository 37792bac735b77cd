"""Responses' `truncation: "auto"`: a conversation longer than the context loses its oldest
items rather than the request failing, as OpenAI's does. A long chain (`previous_response_id`)
or a kept conversation (`conversation`) grows with every turn; on a CPU, whose KV pool often
holds a few thousand tokens, it outgrows the context soon.

Items are dropped from the start of the history (what came before this request's `input`)
up to a user message, so what the model reads still opens with a user's turn and never
holds a function call's output without its call. The fewest are dropped that leave the
prompt and the answer's room (`max_output_tokens`, at least one token) within the context:
the rendered prompt is counted at each cut, the cuts searched by halves. If even the input
alone does not fit, nothing is dropped and the request is refused as before. What is kept
on the server (a stored response's history, a conversation's items) stays whole.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from iterserve.server.chat import chat_plan, prompt_tokens
from iterserve.server.responses_protocol import ResponsesRequest
from iterserve.server.serving import ServingContext


def fitted_history(
    body: ResponsesRequest, history: Sequence[dict[str, Any]], ctx: ServingContext
) -> list[dict[str, Any]]:
    """`history` without its oldest items as far as the context asks (all of it if it fits;
    a blocking count: call it off the event loop)."""
    room = ctx.max_model_len - max(body.max_output_tokens or 1, 1)
    cuts = [i for i, item in enumerate(history) if _is_user_message(item)] + [len(history)]

    def fits(cut: int) -> bool:
        return _prompt_tokens(body, history[cut:], ctx) <= room

    if fits(0):
        return list(history)
    low, high = 0, len(cuts) - 1  # cuts[high] fits if any does
    if not fits(cuts[high]):
        return list(history)
    while low < high:  # the first cut that fits
        middle = (low + high) // 2
        if fits(cuts[middle]):
            high = middle
        else:
            low = middle + 1
    return list(history[cuts[low] :])


def _is_user_message(item: dict[str, Any]) -> bool:
    return item.get("type", "message") == "message" and item.get("role") == "user"


def _prompt_tokens(
    body: ResponsesRequest, history: Sequence[dict[str, Any]], ctx: ServingContext
) -> int:
    chat = body.to_chat_request(history, images=ctx.image_marker is not None)
    plan = chat_plan(chat, ctx, chat.sampling_params(ctx.sampling_defaults))
    return prompt_tokens(chat, ctx, plan)
