"""Tiny rerankers, made here, in the three forms a reranker comes in: a Qwen3
ForSequenceClassification of one label, a Qwen3 causal LM named Qwen3-Reranker (scored from
its LM head's rows of "no" and "yes"), and that LM as llama.cpp's converter writes it into a
GGUF (`cls.output` = the rows of "yes" and "no", pooling type rank, a rerank template)."""

from __future__ import annotations

import shutil
from pathlib import Path

import torch
from transformers import PreTrainedTokenizerFast

from tiny_checkpoints import tiny_hf_model
from tiny_gguf import write_gguf

VOCAB = 49152  # the SmolLM2 tokenizer's (conftest.tokenizer_dir)
SHAPE = dict(
    vocab_size=VOCAB,
    weight_std=0.15,
    hidden_size=64,
    head_dim=32,
    tie_word_embeddings=True,
    max_position_embeddings=512,
    bos_token_id=1,
    eos_token_id=2,
)
# A template as llama.cpp's converter writes one (this tokenizer's special tokens).
TEMPLATE = "<|im_start|>judge\n<Query>: {query}\n<Document>: {document}<|im_end|>\n"


def _tokenizer_files(out: Path, tokenizer_dir: Path) -> None:
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(tokenizer_dir / name, out / name)


def save_classifier(
    out: Path, tokenizer_dir: Path, labels: tuple[str, ...] = ("relevant",)
) -> Path:
    """A random Qwen3ForSequenceClassification of these labels (one: a reranker), with the
    tokenizer."""
    id2label = dict(enumerate(labels))
    model = tiny_hf_model(
        "qwen3_classifier", num_labels=len(labels), id2label=id2label, pad_token_id=0, **SHAPE
    )  # type: ignore[arg-type]
    model.save_pretrained(out)
    _tokenizer_files(out, tokenizer_dir)
    return out


def save_yes_no_reranker(parent: Path, tokenizer_dir: Path) -> Path:
    """A random Qwen3ForCausalLM in a directory named as Qwen3-Reranker's."""
    out = parent / "Qwen3-Reranker-tiny"
    tiny_hf_model("qwen3", **SHAPE).save_pretrained(out)  # type: ignore[arg-type]
    _tokenizer_files(out, tokenizer_dir)
    return out


def write_reranker_gguf(path: Path, reranker_dir: Path) -> Path:
    """`reranker_dir`'s LM as llama.cpp's converter writes a Qwen3-Reranker GGUF."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(reranker_dir, dtype=torch.float32)
    tokenizer = PreTrainedTokenizerFast.from_pretrained(reranker_dir)
    state = {k: v for k, v in model.state_dict().items() if k != "lm_head.weight"}
    table = state["model.embed_tokens.weight"]
    yes, no = tokenizer.convert_tokens_to_ids(["yes", "no"])
    state["score.weight"] = torch.stack([table[yes], table[no]])
    write_gguf(
        path,
        "qwen3",
        model,
        tokenizer,
        state=state,
        metadata={"pooling_type": 4, "classifier.output_labels": ["yes", "no"]},
        named_chat_templates={"rerank": TEMPLATE},
    )
    return path
