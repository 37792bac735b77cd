"""What a loader hands back, whatever the checkpoint's format: shared by loader.py
(HF directories) and gguf_loader.py (GGUF files)."""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

import torch
from transformers import PreTrainedTokenizerBase

from iterserve.model.config import ModelConfig
from iterserve.model.gguf_blocks import QuantizedBlocks
from iterserve.model.images import ImageEncoder
from iterserve.model.lazy_weights import shape_of
from iterserve.sampling_defaults import SamplingDefaults


@dataclass
class LoadedModel:
    config: ModelConfig
    # HF parameter names; no "lm_head.weight" when tied. A loader's are made when read
    # (model/lazy_weights.py).
    weights: Mapping[str, torch.Tensor]
    tokenizer: PreTrainedTokenizerBase
    chat_template: str | None
    name: str  # the served model name
    # Weights the checkpoint stores in a block format the kernels run as is (model/
    # block_formats.py), by HF name: references to their bytes in the file, read when the
    # model is built. `weights` can make every tensor dequantized all the same.
    quantized: dict[str, QuantizedBlocks] = field(default_factory=dict)
    # A reranker's: where its score head (`score.weight`, model/score_head.py) comes from,
    # and the prompt a (query, document) pair is written into ({query}, {document}).
    score_source: str | None = None
    rerank_template: str | None = None
    classifier_labels: list[str] | None = None  # its rows' names (config.json's id2label)
    # Its makers' sampling settings (generation_config.json, a GGUF's general.sampling.*).
    sampling_defaults: SamplingDefaults = field(default_factory=SamplingDefaults)
    # What the file is, for APIs that describe the model (Ollama's /api/show): its format,
    # and a GGUF's type as llama.cpp names it (general.file_type: "Q4_K_M"; "": the dtype).
    file_format: str = "safetensors"
    file_type: str = ""
    # A multimodal checkpoint's vision tower (model/images.py); None: it reads text only.
    images: ImageEncoder | None = None
    # Its vision projector file where one comes with it (an mmproj GGUF beside it in its
    # repository, an Ollama model's projector layer) or the GGUF itself where it holds its
    # tower (Ollama's Gemma 3 files): the engine reads it as `--mmproj` unless told not to.
    projector_file: Path | None = None

    def parameter_count(self) -> int:
        """The checkpoint's weights, counted from their shapes (none of them is made)."""
        return sum(math.prod(shape_of(self.weights, name)) for name in self.weights)
