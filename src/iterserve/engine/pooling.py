"""How this engine's embeddings and scores are made: the pooling and normalization chosen
from the checkpoint's metadata or the flags, which tasks it serves, each request's settings
checked against the model, and a pooled vector turned into the answer (truncated,
normalized; a score's logit into its sigmoid).

Defaults, where the checkpoint says nothing (a plain causal LM): mean pooling, normalized.
vLLM pools a causal LM converted to embeddings by its last token; iterserve takes the mean
because a generative model's last state is shaped for predicting the next token, while the
mean over the prompt is the more even summary of it (sentence-transformers' own default,
and what llama.cpp's embedding examples use) - docs/embeddings.md.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path

from iterserve.config import ConfigError, PoolingConfig
from iterserve.invalid_request import InvalidRequestError
from iterserve.model.errors import ModelLoadError
from iterserve.model.pooling_metadata import PoolingMetadata, read_pooling_metadata
from iterserve.pooling_params import PoolingParams, PoolingType


@dataclass(frozen=True)
class ModelPooling:
    """What the engine serves and how it pools."""

    generate: bool  # completions, chat, responses
    embed: bool  # /v1/embeddings, LLM.embed
    pooling: PoolingType
    normalize: bool
    hidden_size: int
    metadata: PoolingMetadata
    # /classify, LLM.classify: the head's labels, where it serves them (a reranker's one too).
    labels: tuple[str, ...] = ()

    @property
    def score(self) -> bool:
        """/v1/rerank, /v1/score, LLM.score: a served head of one label (a reranker's)."""
        return len(self.labels) == 1

    def describe(self) -> str:
        n = len(self.labels)
        on = [
            ("generate", self.generate),
            ("embed", self.embed),
            ("score", self.score),
            (f"classify ({n} label{'s' * (n > 1)})", n > 0),
        ]
        tasks = " and ".join(t for t, served in on if served)
        if not self.embed:
            return f"{tasks} ({self.metadata.source})"
        norm = ", normalized" if self.normalize else ""
        return f"{tasks}; embeddings: {self.pooling} pooling{norm} ({self.metadata.source})"

    def request_params(self, params: PoolingParams) -> PoolingParams:
        """A request's settings with the model's filled in; InvalidRequestError naming the
        field if the model cannot honour them."""
        if params.task == "score" and not self.score:
            why = (
                f"its classifier has {len(self.labels)} labels, a score needs one"
                if self.labels
                else "it has no reranker's score head; serve a reranker, or see "
                "--classifier-from-tokens"
            )
            raise InvalidRequestError(f"this server does not score: {why}", "model")
        if params.task == "classify" and not self.labels:
            raise InvalidRequestError(
                "this server does not classify: it has no classifier head", "model"
            )
        if params.task != "embed":
            # A causal model's verdict is in its last token's state.
            return replace(params, pooling="last", normalize=False, dimensions=None)
        if not self.embed:
            raise InvalidRequestError(
                "this server does not serve embeddings (--task generate); start it with "
                "--task embed or both",
                "input",
            )
        dimensions = params.dimensions
        if dimensions is not None:
            self._check_dimensions(dimensions)
        return replace(
            params,
            pooling=params.pooling or self.pooling,
            normalize=self.normalize if params.normalize is None else params.normalize,
        )

    def _check_dimensions(self, dimensions: int) -> None:
        meta = self.metadata
        if not meta.matryoshka:
            raise InvalidRequestError(
                "this model's embeddings cannot be shortened: `dimensions` needs a matryoshka "
                "model (is_matryoshka or matryoshka_dimensions in its config)",
                "dimensions",
            )
        allowed = meta.matryoshka_dimensions
        if allowed is not None and dimensions not in allowed:
            raise InvalidRequestError(
                f"dimensions must be one of {list(allowed)}, got {dimensions}", "dimensions"
            )
        if not 1 <= dimensions <= self.hidden_size:
            raise InvalidRequestError(
                f"dimensions must be in [1, {self.hidden_size}], got {dimensions}", "dimensions"
            )


def model_pooling(
    config: PoolingConfig, path: Path, hidden_size: int, labels: Sequence[str] = ()
) -> ModelPooling:
    """Tasks and pooling from `config` (--task, --pooling, --normalize) and the checkpoint;
    `labels`: its score head's (model/score_head.py), none without one."""
    scores = bool(labels)
    meta = read_pooling_metadata(path)
    if meta.unsupported and config.pooling == "auto":
        raise ModelLoadError(
            f"{meta.unsupported}, which iterserve does not make; it pools by last, mean or "
            "cls: choose one with --pooling"
        )
    task = config.task
    if task == "auto":
        task = (
            "score" if scores or meta.scoring_model else "embed" if meta.embedding_model else "both"
        )
    if task == "score" and not scores:
        raise ConfigError(
            f"--task score: {path} has no score head; a reranker is a *ForSequenceClassification "
            "of one label, a GGUF of pooling type rank, or a causal LM told which tokens answer "
            "(--classifier-from-tokens)"
        )
    generate = task in ("generate", "both")
    if generate and not meta.has_lm_head:
        raise ConfigError(
            f"--task {config.task}: {path} is a network without an LM head ({meta.source}): "
            "it makes embeddings, not text; use --task embed"
        )
    pooling = (meta.pooling or "mean") if config.pooling == "auto" else config.pooling
    normalize = config.normalize
    if normalize is None:
        normalize = True if meta.normalize is None else meta.normalize
    embed = task in ("embed", "both")
    head = scores and task in ("score", "both")
    served = tuple(labels) if head else ()
    return ModelPooling(generate, embed, pooling, normalize, hidden_size, meta, served)


def finish_score(vector: list[float]) -> float:
    """A score from its pooled logit: the sigmoid (a one-label classifier's probability)."""
    (logit,) = vector
    return _sigmoid(logit)


def finish_classification(vector: list[float]) -> list[float]:
    """Labels' probabilities from the head's logits: their softmax, or one label's sigmoid
    (transformers' and vLLM's rule for a classifier's activation)."""
    if len(vector) == 1:
        return [_sigmoid(vector[0])]
    top = max(vector)
    exps = [math.exp(x - top) for x in vector]
    total = math.fsum(exps)
    return [e / total for e in exps]


def _sigmoid(x: float) -> float:
    return 0.5 * (1.0 + math.tanh(x / 2))  # no overflow either way


def finish_embedding(vector: list[float], params: PoolingParams) -> list[float]:
    """The answer from a pooled vector: its first `dimensions` numbers, then normalized (as
    sentence-transformers' truncate_dim and OpenAI's `dimensions` do)."""
    if params.dimensions is not None:
        vector = vector[: params.dimensions]
    if params.normalize:
        norm = math.sqrt(math.fsum(x * x for x in vector))
        vector = [x / max(norm, 1e-12) for x in vector]  # torch's F.normalize eps
    return vector
