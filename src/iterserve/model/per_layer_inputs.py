"""Gemma 4's per-layer embeddings (E2B, E4B): a row of inputs for every layer, per token.

A second embedding table gives each token `per_layer_input_size` values for each of the
model's layers ([vocab, layers x size]: 2.3B of E2B's 5.1B weights, which is why it counts as
a 2B model: a step reads one row of it a token, not the table). They are mixed with a
projection of the token's (scaled) embedding, normed per layer:

    inputs = (norm(W e / sqrt(hidden)) + table[id] * sqrt(size)) / sqrt(2)   [T, layers, size]

and layer i gates its slice into its output (model/llama.py, `_DecoderLayer._per_layer`):
h + norm(P (gelu(G h) * inputs[:, i])). The table is looked up as the token embedding is
(model/token_embedding.py): in its file's blocks for a quantized GGUF, never made dense.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from iterserve.model.config import ModelConfig
from iterserve.model.linear import Backend, Linear, WeightMode, WeightPart
from iterserve.model.norms import rms_norm
from iterserve.model.token_embedding import TokenEmbedding

TABLE = "model.embed_tokens_per_layer.weight"
PROJECTION = "model.per_layer_model_projection.weight"
NORM = "model.per_layer_projection_norm.weight"


class PerLayerInputs(nn.Module):
    """The table, the projection and its norm; `forward` gives every layer's inputs."""

    def __init__(self, config: ModelConfig, dtype: torch.dtype, device: torch.device) -> None:
        super().__init__()
        self.layers = config.num_hidden_layers
        self.size = config.per_layer_input_size
        self.vocab = config.per_layer_vocab_size or config.vocab_size
        self.hidden = config.hidden_size
        self.eps = config.rms_norm_eps
        self.dtype = dtype
        self.norm = nn.Parameter(
            torch.empty(self.size, dtype=dtype, device=device), requires_grad=False
        )
        # transformers rounds the table's scale to the model dtype (sqrt(256) = 16: exact).
        scale = torch.tensor(self.size**0.5, dtype=dtype, device=device)
        self.register_buffer("table_scale", scale, persistent=False)
        self.table: TokenEmbedding | None = None
        self.projection: Linear | None = None

    def targets(self) -> dict[str, tuple[torch.Tensor | None, tuple[int, ...]]]:
        """HF name -> (destination of a small tensor or None: built by `build`; shape)."""
        width = self.layers * self.size
        return {
            TABLE: (None, (self.vocab, width)),
            PROJECTION: (None, (width, self.hidden)),
            NORM: (self.norm, (self.size,)),
        }

    def build(
        self,
        part: Callable[[str], WeightPart],
        backend: Backend,
        mode: WeightMode,
    ) -> None:
        self.table = TokenEmbedding(part(TABLE), None, backend, mode, self.dtype)
        self.projection = Linear([part(PROJECTION)], None, backend, mode, self.dtype)

    @property
    def nbytes(self) -> int:
        assert self.table is not None and self.projection is not None
        return self.table.nbytes + self.projection.nbytes

    def forward(self, ids: torch.Tensor, embeddings: torch.Tensor) -> torch.Tensor:
        """[T] token ids and their scaled embeddings [T, hidden] -> [T, layers, size]."""
        assert self.table is not None and self.projection is not None
        tokens = len(ids)
        projected = self.projection(embeddings) * (self.hidden**-0.5)
        projected = rms_norm(projected.view(tokens, self.layers, self.size), self.norm, self.eps)
        rows = self.table(ids).view(tokens, self.layers, self.size) * self.table_scale
        return (projected + rows) * 2.0**-0.5
