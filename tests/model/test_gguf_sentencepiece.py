"""A GGUF's SentencePiece vocabulary (Llama 2, Mistral, Gemma: `tokenizer.ggml.model` "llama")
goes to transformers' GGUF converter through the fast tokenizer class itself
(model/tokenizer.py): the same ids and text as AutoTokenizer's full route, which parses the
whole file once more first."""

from __future__ import annotations

from pathlib import Path

import pytest
from gguf import GGUFWriter
from transformers import AutoTokenizer

from iterserve.model.gguf_loader import read_gguf_header
from iterserve.model.tokenizer import tokenizer_from_gguf

# Pieces in merge order (SentencePiece scores: the earlier, the higher), "▁" for a space.
_PIECES = ["▁", "e", "t", "h", "a", "c", "s", "i", "o", "n", "r", "▁t", "he", "▁the", "▁c",
           "at", "▁cat", "▁a", "▁i", "is", "▁is", "on", "▁on", "in", "▁in", "er", "▁▁"]  # fmt: skip
_TEXTS = [
    "the cat is on the mat",
    "  two  spaces\nnew line",
    "Zürich 🙂",
    "",
    "thethe catcat <s> in",
]


def _sentencepiece_gguf(path: Path, arch: str) -> None:
    """A GGUF of no tensors: a model's shape and a SentencePiece vocabulary (control tokens,
    256 byte tokens, then pieces)."""
    writer = GGUFWriter(path, arch)
    writer.add_context_length(64)
    writer.add_embedding_length(16)
    writer.add_block_count(1)
    writer.add_feed_forward_length(32)
    writer.add_head_count(2)
    writer.add_head_count_kv(2)
    writer.add_layer_norm_rms_eps(1e-6)
    tokens = ["<unk>", "<s>", "</s>", *(f"<0x{b:02X}>" for b in range(256)), *_PIECES]
    writer.add_tokenizer_model("llama")
    writer.add_token_list(tokens)
    writer.add_token_scores([0.0] * 259 + [-float(i) for i in range(len(_PIECES))])
    writer.add_token_types([2, 3, 3] + [6] * 256 + [1] * len(_PIECES))
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    writer.add_unk_token_id(0)
    writer.add_add_bos_token(True)
    writer.add_add_eos_token(False)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


@pytest.mark.parametrize("arch", ["llama", "gemma3"])
def test_a_sentencepiece_vocabulary_tokenizes_as_transformers_full_route(
    arch: str, tmp_path: Path
) -> None:
    path = tmp_path / f"{arch}.gguf"
    _sentencepiece_gguf(path, arch)
    metadata, _ = read_gguf_header(path)
    ours = tokenizer_from_gguf(metadata, path)
    reference = AutoTokenizer.from_pretrained(
        str(tmp_path), gguf_file=path.name, local_files_only=True
    )
    for text in _TEXTS:
        ids = ours(text)["input_ids"]
        assert ids == reference(text)["input_ids"], text
        assert ids[0] == 1  # BOS, as the file asks
        assert ours.decode(ids) == reference.decode(ids)
    special = ("bos_token", "eos_token", "unk_token")
    assert [getattr(ours, s) for s in special] == [getattr(reference, s) for s in special]
