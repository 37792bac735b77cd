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
