"""What a checkpoint says about embeddings: its pooling, whether it normalizes, whether its
vectors may be truncated (matryoshka), and whether it is an embedding model at all.

Read from the files the tools that made it leave:
- sentence-transformers directories: `modules.json` lists the modules (Transformer,
  Pooling, Normalize, ...), the Pooling module's `config.json` its mode
  (`pooling_mode_lasttoken`, `_mean_tokens`, `_cls_token`);
- `config.json` (and `config_sentence_transformers.json`): `is_matryoshka`,
  `matryoshka_dimensions` (vLLM's names), and a bare `*Model` architecture (no LM head);
- GGUF files: `<arch>.pooling_type` (llama.cpp's enum: 1 mean, 2 cls, 3 last, 4 rank: a
  reranker's score).

A reranker (an HF `*ForSequenceClassification`, a GGUF of pooling type rank) is a scoring
model: it pools by its last token and scores (model/score_head.py).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from iterserve.model.errors import ModelLoadError
from iterserve.model.gguf_parts import model_file
from iterserve.model.loader import is_bare_model, is_classifier
from iterserve.pooling_params import PoolingType

# sentence-transformers' pooling modes iterserve pools by: 1_Pooling/config.json says
# `"pooling_mode": "lasttoken"` (sentence-transformers 6) or `"pooling_mode_lasttoken": true`
# (earlier). Any other mode (max, weightedmean, ...) is refused unless --pooling says what
# to do instead.
_ST_MODES: dict[str, PoolingType] = {"lasttoken": "last", "mean": "mean", "cls": "cls"}
_ST_OLD_KEYS = {"lasttoken": "lasttoken", "mean_tokens": "mean", "cls_token": "cls",
                "max_tokens": "max", "mean_sqrt_len_tokens": "mean_sqrt_len_tokens",
                "weightedmean_tokens": "weightedmean"}  # fmt: skip
_GGUF_POOLING: dict[int, PoolingType] = {1: "mean", 2: "cls", 3: "last"}
_GGUF_RANK = 4


@dataclass(frozen=True)
class PoolingMetadata:
    pooling: PoolingType | None = None  # None: the checkpoint does not say
    normalize: bool | None = None
    embedding_model: bool = False  # made for embeddings (--task auto serves only them)
    scoring_model: bool = False  # a reranker (--task auto serves only its scores)
    has_lm_head: bool = True
    matryoshka: bool = False
    matryoshka_dimensions: tuple[int, ...] | None = None
    source: str = "no pooling metadata"
    # Why the checkpoint's own pooling cannot be made here (a mode iterserve lacks): a
    # start-up error unless --pooling chooses another.
    unsupported: str | None = None


def read_pooling_metadata(path: Path) -> PoolingMetadata:
    """The checkpoint's embedding metadata (an HF directory or a GGUF file)."""
    if path.is_dir() and not (path / "config.json").exists():
        path = model_file(path) or path
    if path.is_file():
        return _from_gguf(path)
    config = _json(path / "config.json") or {}
    st_config = _json(path / "config_sentence_transformers.json") or {}
    dims = config.get("matryoshka_dimensions") or st_config.get("matryoshka_dimensions")
    matryoshka = bool(config.get("is_matryoshka") or st_config.get("is_matryoshka") or dims)
    bare = is_bare_model(config)
    if is_classifier(config):
        return PoolingMetadata(
            "last", False, scoring_model=True, has_lm_head=False, source="a classifier head"
        )
    common: dict[str, Any] = {
        "has_lm_head": not bare,
        "matryoshka": matryoshka,
        "matryoshka_dimensions": tuple(int(d) for d in dims) if dims else None,
    }
    modules = _json(path / "modules.json")
    if modules is None:
        source = "a bare model (no LM head)" if bare else "no pooling metadata"
        return PoolingMetadata(embedding_model=bare, source=source, **common)
    pooling: PoolingType | None = None
    unsupported = None
    for module in modules:
        kind = str(module.get("type", ""))
        if kind.endswith("Pooling"):
            pooling, unsupported = _st_pooling(path / module.get("path", ""))
        elif not kind.endswith(("Transformer", "Normalize")):
            raise ModelLoadError(
                f"{path}/modules.json: the sentence-transformers module {kind} is not supported "
                "(iterserve pools and normalizes; it applies no other module)"
            )
    normalize = any(str(m.get("type", "")).endswith("Normalize") for m in modules)
    source = "sentence-transformers modules.json"
    return PoolingMetadata(
        pooling, normalize, True, source=source, unsupported=unsupported, **common
    )


def _st_pooling(directory: Path) -> tuple[PoolingType | None, str | None]:
    """The Pooling module's mode, or why it cannot be made here."""
    config = _json(directory / "config.json") or {}
    modes = config.get("pooling_mode")
    if modes is None:
        modes = [mode for key, mode in _ST_OLD_KEYS.items() if config.get(f"pooling_mode_{key}")]
    modes = [modes] if isinstance(modes, str) else list(modes)
    if len(modes) > 1 or any(m not in _ST_MODES for m in modes):
        return None, f"{directory}/config.json asks for pooling {' + '.join(modes)}"
    if config.get("include_prompt") is False:
        return None, f"{directory}/config.json pools without the prompt's instruction tokens"
    return (_ST_MODES[modes[0]] if modes else None), None


def _from_gguf(path: Path) -> PoolingMetadata:
    from iterserve.model.gguf_loader import read_gguf_header  # needs the gguf package

    metadata, _ = read_gguf_header(path)
    code = metadata.get(f"{metadata.get('general.architecture')}.pooling_type")
    if code is None or code == 0:
        return PoolingMetadata()
    if code == _GGUF_RANK:
        return PoolingMetadata("last", False, scoring_model=True, source="GGUF pooling_type rank")
    if code not in _GGUF_POOLING:
        raise ModelLoadError(f"{path}: GGUF pooling_type {code} is not a pool iterserve makes")
    return PoolingMetadata(_GGUF_POOLING[code], True, True, source="GGUF pooling_type")


def _json(path: Path) -> Any:
    if not path.exists():
        return None
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as error:
        raise ModelLoadError(f"{path} is not valid JSON: {error}") from error
