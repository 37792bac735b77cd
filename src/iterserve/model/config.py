"""The shape of a Llama-family network, whatever file it came from."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class ModelConfig:
    """Architecture hyper-parameters in Hugging Face `config.json` terms.

    `architecture` is one of "llama", "mistral", "qwen2", "mixtral" (SmolLM is "llama").
    `rope_scaling` is the HF dict (e.g. {"rope_type": "llama3", "factor": 8.0, ...}) or None.
    """

    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool = False
    rope_scaling: dict[str, Any] | None = None
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = field(default_factory=tuple)
    # Mistral's sliding window: a query at position p sees keys p - window + 1 .. p only.
    sliding_window: int | None = None
    # Mixtral's sparse MLP (model/moe.py): experts per layer (0: a dense MLP) and how many
    # of them each token is routed to. `intermediate_size` is then one expert's width.
    num_local_experts: int = 0
    num_experts_per_tok: int = 0
