"""A scoring model's head: how a reranker turns a (query, document) prompt into one number,
and a classifier a prompt into its labels' probabilities.

Every form a reranker comes in is made into one row, `score.weight` [1, hidden] (the name
transformers' `*ForSequenceClassification` gives its head): the score is
sigmoid(w . h), h the final-norm state of the prompt's last token. A classifier of N labels
keeps its N rows: softmax(W h) (server/scoring.py's /classify).

- A `*ForSequenceClassification` checkpoint of one label has that row already (loader.py).
- A causal LM trained to answer "yes" or "no" (Qwen3-Reranker, bge-reranker-v2-gemma)
  scores from its LM head's rows of those tokens (`--classifier-from-tokens`, vLLM's
  `classifier_from_token`): one token, its row (the logit of "yes"); two, false then true,
  the second's row minus the first's, whose sigmoid is the two-way softmax's probability
  of the second, as Qwen3-Reranker's model card computes it.
- llama.cpp's converted Qwen3-Reranker GGUF keeps those two rows as `cls.output` ("yes",
  "no") and softmaxes them: the first minus the second (gguf_loader.py).

A Qwen3-Reranker directory (or a GGUF of it without `cls.output`) is known by its name, as
llama.cpp's converter knows it, and scores from "no", "yes" without being told.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import torch

from iterserve.model.errors import ModelLoadError
from iterserve.model.lazy_weights import LazyWeights, shape_of
from iterserve.model.loaded import LoadedModel

SCORE_WEIGHT = "score.weight"
QWEN3_RERANKER_TOKENS = ("no", "yes")
# Qwen3-Reranker's prompt, from its model card (the default instruction it was trained
# with); llama.cpp's converter writes the same into the GGUF as the "rerank" template.
QWEN3_RERANKER_TEMPLATE = (
    "<|im_start|>system\nJudge whether the Document meets the requirements based on the Query "
    'and the Instruct provided. Note that the answer can only be "yes" or "no".<|im_end|>\n'
    "<|im_start|>user\n<Instruct>: Given a web search query, retrieve relevant passages that "
    "answer the query\n<Query>: {query}\n<Document>: {document}<|im_end|>\n"
    "<|im_start|>assistant\n<think>\n\n</think>\n\n"
)


def is_qwen3_reranker(path: Path, loaded: LoadedModel) -> bool:
    """A Qwen3 causal LM whose directory, file or repository says it is Qwen3-Reranker (it has
    no other mark: GGUFs converted before llama.cpp knew rerankers have no cls.output either).
    A repository's name is in its model's (a snapshot's directory is named by its commit)."""
    return (
        loaded.config.architecture == "qwen3"
        and SCORE_WEIGHT not in loaded.weights
        and any("qwen3-reranker" in name.lower() for name in (path.resolve().name, loaded.name))
    )


def score_from_tokens(loaded: LoadedModel, tokens: Sequence[str]) -> None:
    """Give `loaded` a score head made of its LM head's rows of `tokens` (one, or false and
    true); ModelLoadError naming a token that is not one token of its vocabulary."""
    if len(tokens) not in (1, 2):
        raise ModelLoadError(
            f"--classifier-from-tokens takes one token or two (false, true), got {len(tokens)}"
        )
    ids = []
    for token in tokens:
        token_id = loaded.tokenizer.convert_tokens_to_ids(token)
        if (
            not isinstance(token_id, int)
            or loaded.tokenizer.convert_ids_to_tokens(token_id) != token
        ):
            raise ModelLoadError(
                f"--classifier-from-tokens: {token!r} is not a token of the vocabulary"
            )
        ids.append(token_id)
    weights = loaded.weights
    head = "lm_head.weight" if "lm_head.weight" in weights else "model.embed_tokens.weight"
    rows = weights[head][ids].float()
    row = rows[0] if len(ids) == 1 else rows[1] - rows[0]
    _set_score_row(loaded, row, f"the LM head's rows of {', '.join(map(repr, tokens))}")
    loaded.classifier_labels = [tokens[-1]]


def check_score_head(loaded: LoadedModel) -> None:
    """A checkpoint's own classifier reads the hidden state; its labels are named (config's
    id2label, else LABEL_i as transformers names them)."""
    if SCORE_WEIGHT not in loaded.weights:  # (transformers writes id2label in every config)
        loaded.classifier_labels = None
        return
    labels, hidden = shape_of(loaded.weights, SCORE_WEIGHT)
    if hidden != loaded.config.hidden_size:
        raise ModelLoadError(
            f"the checkpoint's classifier reads {hidden} numbers, its states have "
            f"{loaded.config.hidden_size}"
        )
    names = loaded.classifier_labels or []
    if len(names) != labels:
        loaded.classifier_labels = [f"LABEL_{i}" for i in range(labels)]


def _set_score_row(loaded: LoadedModel, row: torch.Tensor, source: str) -> None:
    row = row.reshape(1, -1)
    if isinstance(loaded.weights, LazyWeights):
        loaded.weights.add(SCORE_WEIGHT, tuple(row.shape), lambda: row)
    else:
        loaded.weights = {**loaded.weights, SCORE_WEIGHT: row}
    loaded.score_source = source


def prepare_score_head(loaded: LoadedModel, path: Path, from_tokens: str | None) -> None:
    """Give `loaded` the score head its checkpoint or --classifier-from-tokens says it has
    (and a Qwen3-Reranker directory its prompt); check a checkpoint's own."""
    if from_tokens:
        score_from_tokens(loaded, [t for t in from_tokens.split(",") if t])
    elif is_qwen3_reranker(path, loaded):
        score_from_tokens(loaded, QWEN3_RERANKER_TOKENS)
        loaded.rerank_template = loaded.rerank_template or QWEN3_RERANKER_TEMPLATE
    check_score_head(loaded)
    if SCORE_WEIGHT in loaded.weights and loaded.score_source is None:
        loaded.score_source = "the checkpoint's classifier (score.weight)"
