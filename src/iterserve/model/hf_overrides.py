"""--hf-overrides: a model's context set at serve time, as vLLM's flag sets it. Qwen3's and
Qwen2.5's model cards extend their 32K context to 128K with YaRN this way
(`{"rope_scaling": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings":
32768}}`), and llama.cpp's `--rope-scaling yarn --rope-scale 4 --yarn-orig-ctx 32768` does the
same for a GGUF; here one flag serves both kinds of checkpoint.

Only the keys that set the context are taken (config.py's HF_OVERRIDE_KEYS): any other would
change a network the loaders have already checked, so it is refused at start-up rather than
half applied.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

from iterserve.model.config import ModelConfig
from iterserve.model.errors import ModelLoadError
from iterserve.model.rope import UnsupportedRope, served_rope


def with_hf_overrides(config: ModelConfig, overrides: Mapping[str, Any] | None) -> ModelConfig:
    """`config` with the overrides' RoPE scaling (in HF terms, in place of the checkpoint's)
    and longest sequence; ModelLoadError for a scaling iterserve does not run."""
    if not overrides:
        return config
    positions = int(overrides.get("max_position_embeddings", config.max_position_embeddings))
    scaling = overrides.get("rope_scaling", overrides.get("rope_parameters"))
    if scaling is None:
        return dataclasses.replace(config, max_position_embeddings=positions)
    scaling = {k: v for k, v in scaling.items() if k != "rope_theta"}
    try:
        rope, served = served_rope(scaling, positions)
    except UnsupportedRope as error:
        raise ModelLoadError(f"--hf-overrides: {error}") from None
    return dataclasses.replace(config, rope_scaling=rope, max_position_embeddings=served)
