"""A token's own bytes, which may be part of a UTF-8 character: what logprobs' `bytes` and
llama-server's pieces report (server/), and what llama.cpp's infill sampler compares
(sample/infill_filter.py)."""

from __future__ import annotations

from collections.abc import Callable
from functools import lru_cache
from typing import Any


@lru_cache(maxsize=1)
def _byte_level_values() -> dict[str, int]:
    """Byte-level BPE's characters back to the bytes they stand for (GPT-2's reversible
    map: printable bytes are themselves, the others shifted past 255)."""
    kept = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1),
            *range(ord("®"), ord("ÿ") + 1)]  # fmt: skip
    values = {chr(b): b for b in kept}
    shifted = (b for b in range(256) if b not in values.values())
    values.update({chr(256 + i): b for i, b in enumerate(shifted)})
    return values


def token_bytes(tokenizer: Any, token_id: int) -> bytes:
    """A token's own bytes, which may be part of a UTF-8 character (its decoded text
    would show U+FFFD there): read from a byte-level BPE vocabulary's characters, from a
    SentencePiece byte token (`<0xE2>`) or word mark (`▁`), else its decoded text's."""
    piece = tokenizer.convert_ids_to_tokens(token_id)
    backend = getattr(tokenizer, "backend_tokenizer", None)
    values = _byte_level_values()
    byte_level = backend is not None and "ByteLevel" in repr(backend.decoder)
    if byte_level and all(ch in values for ch in piece):
        return bytes(values[ch] for ch in piece)
    if len(piece) == 6 and piece.startswith("<0x") and piece.endswith(">"):
        return bytes([int(piece[3:5], 16)])
    if "▁" in piece:
        return piece.replace("▁", " ").encode()
    return tokenizer.decode([token_id]).encode()


def token_text_reader(tokenizer: Any) -> Callable[[int], bytes]:
    """A token's text as llama.cpp renders a piece without its special tokens: its bytes,
    and nothing for a special token (cached)."""
    special = frozenset(tokenizer.all_special_ids) | frozenset(tokenizer.get_added_vocab().values())

    @lru_cache(maxsize=65536)
    def text(token_id: int) -> bytes:
        return b"" if token_id in special else token_bytes(tokenizer, token_id)

    return text


def token_byte_reader(tokenizer: Any) -> Callable[[int], bytes]:
    """token_bytes of `tokenizer`, cached as token_decoder's texts are."""

    @lru_cache(maxsize=65536)
    def raw(token_id: int) -> bytes:
        return token_bytes(tokenizer, token_id)

    return raw
