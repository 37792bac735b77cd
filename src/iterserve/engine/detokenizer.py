"""Token ids -> streamed text deltas, and stop strings cut out of that stream.

`IncrementalDetokenizer` uses the prefix-offset / read-offset technique (as in
HF TGI and vLLM): each new token decodes only a short window of recent tokens,
and the delta is what that window's text adds to the text of its first part. Decoding the whole output every token
would cost O(n) per token; decoding the new token alone would be wrong because
a token's text depends on its neighbours (SentencePiece strips the leading space
of the first token decoded; byte-level and byte-fallback tokens carry pieces of
one UTF-8 character).

`StopStringMatcher` sits after it: stop strings can straddle deltas, so text
that might be the start of a stop string is held back until it cannot be.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

# How many prompt tokens give the first output token its context (vLLM uses 5):
# enough to settle the leading-space question and any multi-token character.
_PROMPT_CONTEXT = 5
# Drop consumed tokens once this many pile up before the window, so a long
# generation keeps O(window) state rather than its whole history.
_TRIM_AFTER = 256
# What a lossy UTF-8 decode puts where a character is (so far) incomplete.
_REPLACEMENT = "\ufffd"


def _make_decode(tokenizer: Any, skip_special_tokens: bool) -> Callable[[list[int]], str]:
    """The cheapest faithful `ids -> text` the tokenizer offers.

    A fast tokenizer's Rust backend decodes a few ids without the Python wrapper's
    per-call work (benchmarks/detokenize.py times both). Tokenization-space cleanup is left off either
    way: it rewrites text across token boundaries (" ." -> "."), so it cannot
    be streamed, and for BPE models it corrupts text anyway.
    """
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None:
        return lambda ids: backend.decode(ids, skip_special_tokens=skip_special_tokens)
    return lambda ids: tokenizer.decode(
        ids, skip_special_tokens=skip_special_tokens, clean_up_tokenization_spaces=False
    )


class IncrementalDetokenizer:
    """Streams one sequence's output text, one delta per `add_tokens` call.

    Invariant: the text of `tokens[:read_offset]` has been emitted, and
    `tokens[prefix_offset:read_offset]` is the context the next window starts
    with. A window whose text ends in U+FFFD is an incomplete character (one
    token of a multi-byte sequence): nothing is emitted and the offsets stay
    put until a later token completes it. Call `flush` when the sequence ends
    to release text held for that reason (a genuinely invalid byte sequence).

    The deltas concatenate to the full decode of the output in its context.
    One exception, for invalid UTF-8 only: SentencePiece's ByteFallback decoder
    turns a whole run of byte tokens into U+FFFDs when the run is invalid, so an
    ASCII byte token streamed as itself may read as U+FFFD in a later full
    decode; streamed text is never retracted.
    """

    def __init__(
        self,
        tokenizer: Any,
        prompt_token_ids: Sequence[int],
        skip_special_tokens: bool = True,
    ) -> None:
        self._decode = _make_decode(tokenizer, skip_special_tokens)
        # Only the prompt's tail is needed: it is context, never emitted. A
        # prompt ending inside a character (a byte token) is cut back to the
        # last whole one, so the output's own bytes decode as they would alone.
        context = list(prompt_token_ids[-_PROMPT_CONTEXT:])
        prefix_text = self._decode(context)
        while context and prefix_text.endswith(_REPLACEMENT):
            context.pop()
            prefix_text = self._decode(context)
        self._tokens: list[int] = context
        self._prefix_offset = 0
        self._read_offset = len(context)
        self._prefix_text = prefix_text
        self._parts: list[str] = []
        self._text_cache = ""

    @property
    def output_text(self) -> str:
        """All text emitted so far (the concatenation of the returned deltas)."""
        if len(self._parts) > 1:
            self._text_cache += "".join(self._parts)
            self._parts.clear()
        elif self._parts:
            self._text_cache += self._parts.pop()
        return self._text_cache

    def add_tokens(self, token_ids: Sequence[int]) -> str:
        """Append generated tokens; return the text they complete (may be empty)."""
        # One token at a time, so a character completed mid-batch (speculative
        # decoding appends several) is emitted even if the last one is partial.
        delta = "".join(self._step(token_id) for token_id in token_ids)
        if delta:
            self._parts.append(delta)
        return delta

    def flush(self) -> str:
        """Emit whatever is held back (text ending in U+FFFD); for the end of a sequence."""
        if self._read_offset == len(self._tokens):
            return ""
        text = self._decode(self._tokens[self._prefix_offset :])
        delta = text[len(self._prefix_text) :]
        self._advance()
        if delta:
            self._parts.append(delta)
        return delta

    def _step(self, token_id: int) -> str:
        self._tokens.append(token_id)
        text = self._decode(self._tokens[self._prefix_offset :])
        # Not longer: the token decodes to nothing here (e.g. a skipped special
        # token). Ends in U+FFFD: a character still waits for its other bytes.
        if len(text) <= len(self._prefix_text) or text.endswith(_REPLACEMENT):
            return ""
        delta = text[len(self._prefix_text) :]
        self._advance()
        return delta

    def _advance(self) -> None:
        """Everything decoded is now emitted: the unread tokens become the context."""
        self._prefix_offset, self._read_offset = self._read_offset, len(self._tokens)
        self._prefix_text = self._decode(self._tokens[self._prefix_offset : self._read_offset])
        if self._prefix_offset >= _TRIM_AFTER:
            del self._tokens[: self._prefix_offset]
            self._read_offset -= self._prefix_offset
            self._prefix_offset = 0


class StopStringMatcher:
    """Cuts a text stream at the first stop string to appear in it (OpenAI semantics).

    The stop string itself is not emitted, nor anything after it. Text that
    could still turn out to be the start of a stop string is held back; an
    occurrence cannot start in text already emitted, since the held tail is
    the longest suffix that is a proper prefix of some stop string.

    `include` (vLLM's include_stop_str_in_output): the stop string ends the text instead.
    Nothing is held back then (the text is emitted whether or not a stop completes it);
    the last characters emitted are kept only to find a stop that began in them.
    """

    def __init__(self, stops: Sequence[str], include: bool = False) -> None:
        self._stops = [s for s in stops if s]
        self._longest = max((len(s) for s in self._stops), default=0)
        self._include = include
        self._held = ""  # text not emitted yet (include: emitted, kept to match against)
        self._stopped = False
        self._stop_reason: str | None = None

    @property
    def stopped(self) -> bool:
        return self._stopped

    @property
    def stop_reason(self) -> str | None:
        """The stop string that matched (vLLM's `stop_reason`), or None."""
        return self._stop_reason

    def feed(self, delta: str) -> tuple[str, bool]:
        """(text safe to emit now, whether a stop string has been reached)."""
        if self._stopped:
            return "", True
        if not self._stops:
            return delta, False
        text = self._held + delta
        # Stop where a stop string is first *completed* (as a character-by-
        # character stream would), so the cut does not depend on how the text
        # was split into deltas; of stops completed at the same place, the longest.
        best: tuple[int, int] | None = None  # (end, -length) of the stop to cut at
        for stop in self._stops:
            at = text.find(stop)  # the first occurrence also ends first
            if at != -1 and (best is None or (at + len(stop), -len(stop)) < best):
                best, self._stop_reason = (at + len(stop), -len(stop)), stop
        if best is not None:
            end, length = best
            emitted = len(self._held) if self._include else 0
            self._stopped, self._held = True, ""
            return text[emitted : end if self._include else end + length], True
        if self._include:  # all of it out; the tail kept where a stop may have begun
            self._held = text[max(0, len(text) - self._longest + 1) :]
            return delta, False
        keep = self._partial_match_length(text)
        self._held = text[len(text) - keep :] if keep else ""
        return text[: len(text) - keep], False

    def flush(self) -> str:
        """Release held-back text when the sequence ends for another reason."""
        held, self._held = self._held, ""
        return "" if self._include else held

    def _partial_match_length(self, text: str) -> int:
        """Length of the longest suffix of `text` that is a proper prefix of a stop string."""
        for length in range(min(self._longest - 1, len(text)), 0, -1):
            tail = text[-length:]
            if any(len(stop) > length and stop.startswith(tail) for stop in self._stops):
                return length
        return 0
