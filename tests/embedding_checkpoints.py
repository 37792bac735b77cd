"""Tiny embedding checkpoints, made here: a random Qwen3 with sentence-transformers' files
(last-token pooling, a Normalize module), as its LM-headed directory or as
sentence-transformers itself saves it (a bare Qwen3Model)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from tiny_checkpoints import tiny_hf_model

VOCAB = 49152  # the SmolLM2 tokenizer's (conftest.tokenizer_dir)
HIDDEN = 64
MATRYOSHKA_DIMENSIONS = [16, 32, 64]
_ST_MODULE = "sentence_transformers.{}.modules.{}"


def save_embedding_qwen3(out: Path, tokenizer_dir: Path) -> Path:
    """A tiny random Qwen3ForCausalLM plus the files sentence-transformers 6 writes for
    last-token pooling and normalizing, and matryoshka dimensions in config.json."""
    model = tiny_hf_model(
        "qwen3",
        vocab_size=VOCAB,
        weight_std=0.15,
        hidden_size=HIDDEN,
        head_dim=32,
        tie_word_embeddings=True,
        max_position_embeddings=512,
        bos_token_id=1,
        eos_token_id=2,
    )
    model.save_pretrained(out)
    # No chat template: sentence-transformers 6 would wrap each text in it, where an
    # embeddings API (OpenAI's, vLLM's, iterserve's) embeds the text as given.
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(tokenizer_dir / name, out / name)
    config = json.loads((out / "config.json").read_text())
    config["matryoshka_dimensions"] = MATRYOSHKA_DIMENSIONS
    (out / "config.json").write_text(json.dumps(config))
    modules = [
        ("", _ST_MODULE.format("base", "transformer.Transformer")),
        ("1_Pooling", _ST_MODULE.format("sentence_transformer", "pooling.Pooling")),
        ("2_Normalize", _ST_MODULE.format("base", "normalize.Normalize")),
    ]
    (out / "modules.json").write_text(
        json.dumps(
            [{"idx": i, "name": str(i), "path": p, "type": t} for i, (p, t) in enumerate(modules)]
        )
    )
    (out / "1_Pooling").mkdir()
    pooling = {"embedding_dimension": HIDDEN, "pooling_mode": "lasttoken", "include_prompt": True}
    (out / "1_Pooling" / "config.json").write_text(json.dumps(pooling))
    (out / "2_Normalize").mkdir()
    (out / "sentence_bert_config.json").write_text(
        json.dumps({"transformer_task": "feature-extraction"})
    )
    return out


def resave_bare(st_model: object, out: Path) -> Path:
    """`st_model` (a SentenceTransformer) saved by sentence-transformers itself: a bare
    Qwen3Model, weights without `model.`, no LM head."""
    st_model.save(str(out))  # type: ignore[attr-defined]
    return out
