"""The parts of the sampling controls that need the model's tokenizer or vocabulary,
resolved once when a request is added (the sampler then works on token ids only)."""

from __future__ import annotations

from typing import Any

from iterserve.sampling_params import InvalidRequestError, SamplingParams


def check_token_ids(params: SamplingParams, vocab_size: int) -> None:
    """Refuse token ids the model has no logit for (400 naming the field)."""
    for name, token_ids in (
        ("logit_bias", list(params.logit_bias or {})),
        ("stop_token_ids", params.stop_token_ids),
        ("allowed_token_ids", params.allowed_token_ids or []),
    ):
        outside = [t for t in token_ids if not 0 <= t < vocab_size]
        if outside:
            raise InvalidRequestError(
                f"{name} names token ids outside the vocabulary [0, {vocab_size}): {outside[:5]}",
                name,
            )


def bad_words_token_ids(tokenizer: Any, words: list[str], vocab_size: int) -> list[list[int]]:
    """vLLM's rule: each word as it tokenizes at the start of a text, and, when it makes
    a different first token of the same length, after a space (mid-text). A word the
    tokenizer writes with no token at all (a control character it drops) can never be
    sampled: there is nothing to ban."""
    sequences: list[list[int]] = []
    for word in words:
        alone = tokenizer.encode(word.lstrip(), add_special_tokens=False)
        if not alone:
            continue
        spaced = tokenizer.encode(" " + word.lstrip(), add_special_tokens=False)
        sequences.append(alone)
        if spaced and spaced[0] != alone[0] and len(spaced) == len(alone):
            sequences.append(spaced)
    if any(not 0 <= t < vocab_size for ids in sequences for t in ids):
        raise InvalidRequestError("bad_words tokenize outside the model's vocabulary", "bad_words")
    return sequences
