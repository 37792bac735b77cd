"""TokenLogprobs (core/outputs.py) in the two OpenAI shapes: completions' parallel
lists and chat's list of {token, logprob, bytes, top_logprobs}."""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from functools import lru_cache
from typing import Any

from iterserve.core.outputs import TokenLogprobs
from iterserve.server.protocol import ChatLogprob, ChatTokenLogprob, CompletionLogprobs

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


def completion_logprobs(
    entries: Sequence[TokenLogprobs | None], decode: Callable[[int], str], text_offset: int
) -> CompletionLogprobs:
    """`text_offset` is where the entries' text starts in the choice."""
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
        top = {decode(tid): _finite(lp) for tid, lp in entry.top}
        top.setdefault(token, _finite(entry.logprob))
        result.top_logprobs.append(top)
    return result


def chat_logprobs(
    entries: Sequence[TokenLogprobs | None], decode: Callable[[int], str]
) -> list[ChatTokenLogprob]:
    content = []
    for entry in entries:
        if entry is None:
            continue
        token = decode(entry.token_id)
        content.append(
            ChatTokenLogprob(
                token=token,
                logprob=_finite(entry.logprob),
                bytes=list(token.encode("utf-8")),
                top_logprobs=[
                    ChatLogprob(
                        token=decode(tid),
                        logprob=_finite(lp),
                        bytes=list(decode(tid).encode("utf-8")),
                    )
                    for tid, lp in entry.top
                ],
            )
        )
    return content
