"""Tokenizers for the two checkpoint formats: an HF directory, and the metadata inside a GGUF."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers, processors
from transformers import AutoTokenizer, PreTrainedTokenizerBase, PreTrainedTokenizerFast

# llama.cpp's token types (llama_token_type): only these two are matched whole before BPE runs.
_TOKEN_TYPE_CONTROL = 3
_TOKEN_TYPE_USER_DEFINED = 4

# How each `tokenizer.ggml.pre` value splits text before byte-level BPE, whether a split word
# that is itself in the vocabulary is taken whole before any merge (llama.cpp's
# `ignore_merges`, transformers' BPE `ignore_merges`: Llama 3's tokenizer.json sets it), and
# whether BOS is added when the file does not say (`tokenizer.ggml.add_bos_token`), as
# llama.cpp's llama-vocab.cpp maps the names it knows. A vocabulary only reproduces its
# training-time tokens when text is split the way its merges were learned, so an unknown value
# must not silently fall back to GPT-2's split: those files go through transformers' own GGUF
# converter instead.
_GPT2_SPLIT = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
# Mistral's Tekken (Mistral Nemo, Ministral) and OpenAI's o200k (tiktoken's o200k_base:
# Phi-4-mini, llama.cpp's "gpt-4o") split words at case changes; o200k attaches English
# contractions and takes digits in threes, Tekken one by one. The regexes of their
# tokenizer.json files, in parts.
_CASED_WORD = r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+"
_CAPS_WORD = r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*"
_CONTRACTION = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
_CASED_REST = r"| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
_TEKKEN_SPLIT = _CASED_WORD + "|" + _CAPS_WORD + r"|\p{N}" + _CASED_REST
_GPT4O_SPLIT = (
    _CASED_WORD + _CONTRACTION + "|" + _CAPS_WORD + _CONTRACTION + r"|\p{N}{1,3}" + _CASED_REST
)


@dataclass(frozen=True)
class _PreTokenizer:
    splits: tuple[str, ...]
    ignore_merges: bool = False
    add_bos: bool = False


_GPT2 = _PreTokenizer((_GPT2_SPLIT,))
_LLAMA3 = _PreTokenizer((_LLAMA3_SPLIT,), ignore_merges=True, add_bos=True)
_QWEN2 = _PreTokenizer((_QWEN2_SPLIT,))
_TEKKEN = _PreTokenizer((_TEKKEN_SPLIT,), ignore_merges=True, add_bos=True)
_GPT4O = _PreTokenizer((_GPT4O_SPLIT,))
# SmolLM (and StarCoder, whose vocabulary it reuses) puts every digit in a word of its own first.
_DIGITS_THEN_GPT2 = _PreTokenizer((r"\p{N}", _GPT2_SPLIT))
# llama.cpp's fallback for "default" and for files without the key (GGUFs older than it):
# runs of punctuation first, then GPT-2's split, then digit runs cut in threes.
_LLAMA_CPP_DEFAULT = _PreTokenizer(
    (r"[\p{P}\$\+<=>\^~\|]+", _GPT2_SPLIT, r"\p{N}+", r"[0-9][0-9][0-9]")
)
_PRE_TOKENIZERS: dict[str, _PreTokenizer] = {
    "default": _LLAMA_CPP_DEFAULT,
    "gpt-2": _GPT2,
    "phi-2": _GPT2,
    "smollm": _DIGITS_THEN_GPT2,
    "starcoder": _DIGITS_THEN_GPT2,
    "refact": _DIGITS_THEN_GPT2,  # llama.cpp splits Refact's as StarCoder's
    "llama-bpe": _LLAMA3,
    "llama3": _LLAMA3,
    "llama-v3": _LLAMA3,
    "falcon3": _LLAMA3,  # Falcon 3: a Llama body with a Llama 3 style vocabulary
    "qwen2": _QWEN2,
    "deepseek-r1-qwen": _QWEN2,  # the DeepSeek-R1 distillations into Qwen 2.5
    "tekken": _TEKKEN,
    "gpt-4o": _GPT4O,  # Phi-4-mini
}


def load_hf_tokenizer(directory: Path) -> PreTrainedTokenizerBase:
    """The tokenizer saved in an HF model directory; never looks at the hub."""
    return AutoTokenizer.from_pretrained(str(directory), local_files_only=True)


def chat_template_of(tokenizer: PreTrainedTokenizerBase) -> str | None:
    """The default chat template; older tokenizers may hold a {name: template} dict."""
    template = getattr(tokenizer, "chat_template", None)
    if isinstance(template, dict):
        template = template.get("default") or next(iter(template.values()), None)
    return template or None


def tokenizer_from_gguf(metadata: Mapping[str, Any], gguf_path: Path) -> PreTrainedTokenizerBase:
    """The tokenizer a GGUF describes in its `tokenizer.*` metadata.

    Byte-level BPE vocabularies with a known split are built directly (well under a second);
    anything else (SentencePiece vocabularies: Llama 2, Mistral, Gemma) is handed to
    transformers' GGUF converter, which knows more tokenizer kinds. Through the fast tokenizer
    class, not AutoTokenizer: that one first parses the whole file once more to learn the model
    type, which for Gemma 3's 262,144 tokens made the load of a 241 MiB file 16 s and its peak
    RSS 1.00 GiB (benchmarks/big_models.py --files, 2026-11-30, avx512bf16).
    """
    kind = metadata.get("tokenizer.ggml.model")
    pre = metadata.get("tokenizer.ggml.pre", "default")
    if kind == "gpt2" and pre in _PRE_TOKENIZERS and "tokenizer.ggml.merges" in metadata:
        tokenizer = _byte_level_bpe(metadata, _PRE_TOKENIZERS[pre])
    else:
        tokenizer = PreTrainedTokenizerFast.from_pretrained(
            str(gguf_path.parent), gguf_file=gguf_path.name, local_files_only=True
        )
    template = metadata.get("tokenizer.chat_template")
    if template:
        tokenizer.chat_template = template
    return tokenizer


def _byte_level_bpe(metadata: Mapping[str, Any], pre: _PreTokenizer) -> PreTrainedTokenizerFast:
    tokens: list[str] = metadata["tokenizer.ggml.tokens"]
    merges = [tuple(merge.split(" ", 1)) for merge in metadata["tokenizer.ggml.merges"]]
    backend = Tokenizer(
        models.BPE(
            vocab={t: i for i, t in enumerate(tokens)},
            merges=merges,
            ignore_merges=pre.ignore_merges,
        )
    )
    backend.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Split(Regex(split), behavior="isolated") for split in pre.splits]
        # The regexes above already did the splitting; ByteLevel only maps bytes to its alphabet.
        + [pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)]
    )
    backend.decoder = decoders.ByteLevel()

    token_types: list[int] = metadata.get("tokenizer.ggml.token_type", [])
    backend.add_special_tokens(
        [
            AddedToken(tokens[i], special=True, normalized=False)
            for i, kind in enumerate(token_types)
            if kind == _TOKEN_TYPE_CONTROL
        ]
    )
    backend.add_tokens(
        [
            AddedToken(tokens[i], special=False, normalized=False)
            for i, kind in enumerate(token_types)
            if kind == _TOKEN_TYPE_USER_DEFINED
        ]
    )

    def token(key: str) -> str | None:
        token_id = metadata.get(f"tokenizer.ggml.{key}_token_id")
        return tokens[token_id] if token_id is not None and 0 <= token_id < len(tokens) else None

    bos, eos = token("bos"), token("eos")
    add_bos = bos is not None and metadata.get("tokenizer.ggml.add_bos_token", pre.add_bos)
    add_eos = eos is not None and metadata.get("tokenizer.ggml.add_eos_token", False)
    backend.post_processor = _bos_eos_processor(
        (bos, metadata["tokenizer.ggml.bos_token_id"]) if add_bos else None,
        (eos, metadata["tokenizer.ggml.eos_token_id"]) if add_eos else None,
    )
    return PreTrainedTokenizerFast(
        tokenizer_object=backend,
        bos_token=bos,
        eos_token=eos,
        unk_token=token("unknown"),
        pad_token=token("padding"),
        # llama.cpp detokenizes byte for byte; HF's clean-up would eat spaces before punctuation.
        clean_up_tokenization_spaces=False,
    )


def _bos_eos_processor(
    bos: tuple[str, int] | None, eos: tuple[str, int] | None
) -> processors.PostProcessor:
    """Adds BOS/EOS around encoded text when the GGUF asks for it (llama.cpp's add_bos_token)."""
    if bos is None and eos is None:
        return processors.ByteLevel(trim_offsets=False)
    prefix = f"{bos[0]}:0 " if bos else ""
    suffix = f" {eos[0]}:0" if eos else ""
    return processors.TemplateProcessing(
        single=f"{prefix}$A:0{suffix}",
        pair=f"{prefix}$A:0{suffix} {prefix}$B:1{suffix}",
        special_tokens=[special for special in (bos, eos) if special is not None],
    )
