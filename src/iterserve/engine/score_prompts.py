"""How a (query, document) pair becomes one prompt for a reranker.

With a template (the GGUF's `rerank` template, as llama.cpp's converter writes it;
Qwen3-Reranker's own; or --rerank-template), the pair is written into it and the text
tokenized with its special tokens read and none added, as llama.cpp's server does. Without
one, the tokenizer encodes the pair as transformers and vLLM give a cross-encoder its
input: the query, then the document, with whatever its post-processor puts around and
between them (a Qwen tokenizer puts nothing).
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

from iterserve.config import ConfigError
from iterserve.engine.prompts import encode_text
from iterserve.sampling_params import InvalidRequestError

_PLACEHOLDER = re.compile(r"\{(query|document)\}")


class PairPrompts:
    def __init__(self, tokenizer: Any, template: str | None) -> None:
        self.tokenizer = tokenizer
        self.template = template

    def __call__(self, query: str, document: str) -> list[int]:
        """The pair's token ids; InvalidRequestError naming the field the tokenizer refused."""
        if self.template is not None:
            # One pass, so that a query holding "{document}" stays as it is.
            text = _PLACEHOLDER.sub(lambda m: query if m[1] == "query" else document, self.template)
            return encode_text(self.tokenizer, text, False, "documents")
        try:
            return list(self.tokenizer(query, document)["input_ids"])
        except (TypeError, ValueError):
            for text, field in ((query, "query"), (document, "documents")):
                encode_text(self.tokenizer, text, False, field)  # a 400 naming which
            raise


def rerank_template(flag: str | None, loaded_template: str | None) -> str | None:
    """--rerank-template (its text, or a file holding it) over the checkpoint's template;
    ConfigError if it lacks a placeholder."""
    if flag is None:
        return loaded_template
    path = Path(flag).expanduser()
    template = path.read_text() if "{" not in flag and path.is_file() else flag
    missing = [p for p in ("{query}", "{document}") if p not in template]
    if missing:
        raise ConfigError(f"--rerank-template has no {' and no '.join(missing)}")
    return template


def score_pairs(text_1: str | list[str], text_2: str | list[str]) -> list[tuple[str, str]]:
    """The pairs a score request asks for, as vLLM's /score pairs them: one text_1 with each
    text_2, or the two lists item by item; InvalidRequestError naming the field that is
    empty or does not match."""
    firsts = [text_1] if isinstance(text_1, str) else list(text_1)
    seconds = [text_2] if isinstance(text_2, str) else list(text_2)
    for texts, field in ((firsts, "text_1"), (seconds, "text_2")):
        if not texts:
            raise InvalidRequestError(f"{field} must not be empty", field)
    if len(firsts) == 1:
        return [(firsts[0], text) for text in seconds]
    if len(firsts) != len(seconds):
        raise InvalidRequestError(
            f"text_1 has {len(firsts)} texts and text_2 {len(seconds)}: give one text_1, or "
            "as many as text_2",
            "text_2",
        )
    return list(zip(firsts, seconds, strict=True))
