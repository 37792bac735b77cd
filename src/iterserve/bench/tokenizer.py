"""The tokenizer workloads are built with: the served model's, so prompt lengths are exact.

Loads only the tokenizer (never weights): a client benchmarking a remote server needs the
same vocabulary as the server, not its model.
"""

from __future__ import annotations

from typing import Any

from iterserve.model.gguf_parts import model_file
from iterserve.model.model_source import find_model


def load_tokenizer(spec: str | None = None) -> Any:
    """An HF directory, a .gguf file (or a directory holding one), or None for the bundled model."""
    path = find_model(spec).path
    if path.is_dir() and not (path / "tokenizer.json").exists():
        path = model_file(path) or path
    if path.is_file():
        from iterserve.model.gguf_loader import read_gguf_header
        from iterserve.model.tokenizer import tokenizer_from_gguf

        # The header alone holds the vocabulary: a second, where transformers' own GGUF
        # tokenizer conversion re-reads the whole file.
        metadata, _ = read_gguf_header(path)
        return tokenizer_from_gguf(metadata, path)
    from iterserve.model.tokenizer import load_hf_tokenizer

    return load_hf_tokenizer(path)


def ordinary_token_ids(tokenizer: Any) -> list[int]:
    """Ids of plain vocabulary entries: no special, control or added tokens.

    A prompt drawn from these cannot contain an EOS or a chat-template marker that would
    change how a server treats it.
    """
    excluded = set(tokenizer.all_special_ids) | set(tokenizer.get_added_vocab().values())
    return [i for i in range(tokenizer.vocab_size) if i not in excluded]
