"""What the served model is, for APIs that describe it (Ollama's /api/tags and /api/show)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ModelFacts:
    """What the served model is, for APIs that describe it (Ollama's /api/tags and
    /api/show): its family, parameter count, file format and the file's weight type."""

    architecture: str = ""
    parameters: int = 0
    file_format: str = ""  # "gguf", "safetensors"
    file_type: str = ""  # a GGUF's ("Q4_K_M"); "": the model's dtype
    # What its chat template writes where an image goes ("[IMG]"); None: it takes no images.
    image_marker: str | None = None
