"""Byte-level BPE vocabularies read from a GGUF's metadata split and merge as llama.cpp does
for their `tokenizer.ggml.pre` name (llama-vocab.cpp)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from iterserve.model.tokenizer import tokenizer_from_gguf

# Single bytes (ByteLevel's alphabet: "Ġ" is the space), the merges "a b" and "1 2", and
# words no merge reaches: "abc", "123" and "Ab".
_TOKENS = ["a", "b", "c", "A", "Ġ", "1", "2", "3", "ab", "12", "abc", "123", "Ab", "<bos>"]
_MERGES = ["a b", "1 2"]
_CONTROL, _NORMAL = 3, 1


def _metadata(pre: str, **extra: Any) -> dict[str, Any]:
    return {
        "tokenizer.ggml.model": "gpt2",
        "tokenizer.ggml.pre": pre,
        "tokenizer.ggml.tokens": _TOKENS,
        "tokenizer.ggml.merges": _MERGES,
        "tokenizer.ggml.token_type": [_NORMAL] * (len(_TOKENS) - 1) + [_CONTROL],
        "tokenizer.ggml.bos_token_id": len(_TOKENS) - 1,
        **{f"tokenizer.ggml.{key}": value for key, value in extra.items()},
    }


def _pieces(pre: str, text: str, **extra: Any) -> list[str]:
    # A known name is built from the metadata alone: the file is never opened.
    tokenizer = tokenizer_from_gguf(_metadata(pre, **extra), Path("/nonexistent/model.gguf"))
    return tokenizer.convert_ids_to_tokens(tokenizer.encode(text))


@pytest.mark.parametrize("pre", ["llama-bpe", "llama3", "llama-v3", "falcon3"])
def test_llama3_vocabularies_take_a_word_in_the_vocabulary_whole(pre: str) -> None:
    # llama.cpp's LLAMA3 pre-type sets ignore_merges: "abc" is a token, so no merge is tried.
    # Digits go in words of up to three. BOS first, unless the file says otherwise.
    assert _pieces(pre, "abc 123") == ["<bos>", "abc", "Ġ", "123"]
    assert _pieces(pre, "abc", add_bos_token=False) == ["abc"]


@pytest.mark.parametrize("pre", ["gpt-2", "default", "phi-2"])
def test_gpt2_vocabularies_merge_their_way_up(pre: str) -> None:
    assert _pieces(pre, "abc 123") == ["ab", "c", "Ġ", "12", "3"]
    assert _pieces(pre, "abc", add_bos_token=True) == ["<bos>", "ab", "c"]


@pytest.mark.parametrize("pre", ["qwen2", "deepseek-r1-qwen"])
def test_qwen2_vocabularies_split_every_digit(pre: str) -> None:
    assert _pieces(pre, "abc 123") == ["ab", "c", "Ġ", "1", "2", "3"]


def test_tekken_vocabularies_split_at_a_capital_and_between_digits() -> None:
    # Mistral's Tekken: "abAb" is two words, each in the vocabulary; digits one by one; BOS
    # first unless the file says otherwise.
    assert _pieces("tekken", "abAb 123") == ["<bos>", "ab", "Ab", "Ġ", "1", "2", "3"]
    # Llama 3's split keeps "abAb" one word, which merges as far as "ab", "A", "b".
    assert _pieces("llama-bpe", "abAb", add_bos_token=False) == ["ab", "A", "b"]


def test_gpt4o_vocabularies_split_at_a_capital_and_take_digits_in_threes() -> None:
    # OpenAI's o200k split (Phi-4-mini): words split at case changes as Tekken's, but digits
    # in words of up to three, merges applied (llama.cpp does not ignore them for "gpt-4o")
    # and no BOS unless the file asks for it.
    assert _pieces("gpt-4o", "abAb 1231") == ["ab", "A", "b", "Ġ", "12", "3", "1"]
    assert _pieces("gpt-4o", "abc", add_bos_token=True) == ["<bos>", "ab", "c"]


@pytest.mark.parametrize("pre", ["default", None])
def test_default_and_missing_splits_are_llama_cpps_fallback(pre: str | None) -> None:
    # llama.cpp's fallback (for "default" and for files older than the key): punctuation
    # runs cut out first, then GPT-2's split, then digit runs in threes, so neither the
    # space before "1234" nor the one before "!" can merge with what follows.
    tokens = ["x", "Ġ", "1", "2", "3", "4", "!", "Ġ1", "23", "Ġ!"]
    metadata: dict[str, Any] = {
        "tokenizer.ggml.model": "gpt2",
        "tokenizer.ggml.tokens": tokens,
        "tokenizer.ggml.merges": ["Ġ 1", "2 3", "Ġ !"],
        "tokenizer.ggml.token_type": [_NORMAL] * len(tokens),
        "tokenizer.ggml.bos_token_id": 0,
    }
    if pre is not None:
        metadata["tokenizer.ggml.pre"] = pre
    tokenizer = tokenizer_from_gguf(metadata, Path("/nonexistent/model.gguf"))
    pieces = tokenizer.convert_ids_to_tokens(tokenizer.encode("x 1234 !"))
    assert pieces == ["x", "Ġ", "1", "23", "4", "Ġ", "!"]
    gpt2 = tokenizer_from_gguf({**metadata, "tokenizer.ggml.pre": "gpt-2"}, Path("/x.gguf"))
    assert gpt2.convert_ids_to_tokens(gpt2.encode("x 1234 !")) == ["x", "Ġ1", "23", "4", "Ġ!"]


@pytest.mark.parametrize("pre", ["smollm", "starcoder", "refact"])
def test_starcoder_vocabularies_put_every_digit_in_a_word_of_its_own(pre: str) -> None:
    # llama.cpp's STARCODER split (SmolLM's, Refact's): digits cut out one by one, then
    # GPT-2's split, so the merge "1 2" never sees two digits in one word.
    assert _pieces(pre, "abc 123") == ["ab", "c", "Ġ", "1", "2", "3"]
