"""TokenLogprobs (core/logprobs.py) in the two OpenAI shapes, completions' parallel lists
and chat's list of {token, logprob, bytes, top_logprobs}, and in vLLM's `prompt_logprobs`
(per prompt position, token id -> {logprob, rank, decoded_token})."""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from functools import lru_cache
from typing import Any

from iterserve.core.outputs import TokenLogprobs
from iterserve.server.protocol import (
    ChatLogprob,
    ChatTokenLogprob,
    CompletionLogprobs,
    PromptLogprob,
    PromptLogprobs,
)

# JSON has no -inf; vLLM sends this floor instead, and clients expect a number.
_MIN_LOGPROB = -9999.0


def _finite(logprob: float) -> float:
    return logprob if math.isfinite(logprob) else _MIN_LOGPROB


def token_decoder(tokenizer: Any) -> Callable[[int], str]:
    """A token id's text as a client sees it (a partial UTF-8 sequence shows as U+FFFD).

    Cached: the same few thousand tokens come up again and again.
    """

    @lru_cache(maxsize=65536)
    def decode(token_id: int) -> str:
        return tokenizer.decode([token_id])

    return decode


def token_names(decode: Callable[[int], str], as_ids: bool | None) -> Callable[[int], str]:
    """How logprobs name tokens: by their text, or (vLLM's return_tokens_as_token_ids) as
    "token_id:N", which a client maps back without the tokenizer."""
    return _token_id_name if as_ids else decode


def _token_id_name(token_id: int) -> str:
    return f"token_id:{token_id}"


def prompt_logprobs(
    entries: Sequence[TokenLogprobs | None], top_n: int, decode: Callable[[int], str]
) -> PromptLogprobs:
    """Each position's prompt token, then the top_n there not already listed (the engine
    may have scored more, for echo); None where nothing was scored (the first token)."""
    result: PromptLogprobs = []
    for entry in entries:
        if entry is None:
            result.append(None)
            continue
        ranked = [(entry.token_id, entry.logprob, entry.rank)]
        ranked += [(tid, lp, rank) for rank, (tid, lp) in enumerate(entry.top[:top_n], 1)]
        position: dict[str, PromptLogprob] = {}
        for token_id, logprob, rank in ranked:
            position.setdefault(
                str(token_id),
                PromptLogprob(logprob=_finite(logprob), rank=rank, decoded_token=decode(token_id)),
            )
        result.append(position)
    return result


def completion_logprobs(
    entries: Sequence[TokenLogprobs | None],
    decode: Callable[[int], str],
    text_offset: int,
    top_n: int | None = None,
) -> CompletionLogprobs:
    """`text_offset` is where the entries' text starts in the choice; `top_n`: at most so
    many of each entry's top (the engine may have scored more for another field)."""
    result = CompletionLogprobs()
    for entry in entries:
        if entry is None:
            continue
        token = decode(entry.token_id)
        result.tokens.append(token)
        result.token_logprobs.append(_finite(entry.logprob))
        result.text_offset.append(text_offset)
        text_offset += len(token)
        # The sampled token is listed too, as vLLM does, even when outside the top n.
        top = {decode(tid): _finite(lp) for tid, lp in entry.top[:top_n]}
        top.setdefault(token, _finite(entry.logprob))
        result.top_logprobs.append(top)
    return result


def chat_logprobs(
    entries: Sequence[TokenLogprobs | None],
    decode: Callable[[int], str],
    raw: Callable[[int], bytes],
) -> list[ChatTokenLogprob]:
    """`raw`: a token's own bytes (token_byte_reader), which a client joins to rebuild the
    text where a token holds part of a character (its `token` then shows U+FFFD)."""
    content = []
    for entry in entries:
        if entry is None:
            continue
        content.append(
            ChatTokenLogprob(
                token=decode(entry.token_id),
                logprob=_finite(entry.logprob),
                bytes=list(raw(entry.token_id)),
                top_logprobs=[
                    ChatLogprob(token=decode(tid), logprob=_finite(lp), bytes=list(raw(tid)))
                    for tid, lp in entry.top
                ],
            )
        )
    return content
