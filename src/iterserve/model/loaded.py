"""What a loader hands back, whatever the checkpoint's format: shared by loader.py
(HF directories) and gguf_loader.py (GGUF files)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

import torch
from transformers import PreTrainedTokenizerBase

from iterserve.model.config import ModelConfig
from iterserve.model.kquant import BlockWeight


@dataclass
class LoadedModel:
    config: ModelConfig
    # HF parameter names; no "lm_head.weight" when tied. A loader's are made when read
    # (model/lazy_weights.py).
    weights: Mapping[str, torch.Tensor]
    tokenizer: PreTrainedTokenizerBase
    chat_template: str | None
    name: str  # the served model name
    # Weights the checkpoint stores in a block format our kernels read as is (GGUF Q4_0, Q4_1,
    # Q8_0, Q5_0, Q5_1, Q4_K, Q5_K, Q6_K), by HF name; `weights` holds every tensor
    # dequantized all the same.
    quantized: dict[str, BlockWeight] = field(default_factory=dict)
