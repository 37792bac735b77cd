"""Models Ollama has already pulled, named as Ollama names them: `iterserve serve llama3.2:3b`
(or `qwen3`, `hf.co/bartowski/Llama-3.2-1B-Instruct-GGUF:Q4_K_M`) serves the GGUF that
`ollama pull` left on disk. Nothing is downloaded.

Ollama keeps a model as a manifest (`manifests/HOST/NAMESPACE/MODEL/TAG`: JSON naming its
layers by digest) and content-addressed blobs (`blobs/sha256-HEX`), under `$OLLAMA_MODELS`,
else `~/.ollama/models`, else `/usr/share/ollama/.ollama/models` (where Linux's service
install keeps them). A name's host defaults to `registry.ollama.ai`, its namespace to
`library`, its tag to `latest`. The model layer is the GGUF itself; the params layer holds
the Modelfile's PARAMETERs (JSON), whose sampling settings become the model's own defaults
(as a GGUF's general.sampling.* are). The template layer is Ollama's Go template: the GGUF's
own Jinja chat template renders the chats here. A projector layer (a vision projector
file) is read as the model's `--mmproj` (engine/llm_engine.py); an adapter layer is left
out.

Names and small JSON files only: the GGUF is opened by its loader.
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from iterserve.model.errors import ModelLoadError

DEFAULT_HOST = "registry.ollama.ai"
_MODEL_LAYER = "application/vnd.ollama.image.model"
_PARAMS_LAYER = "application/vnd.ollama.image.params"
_PROJECTOR_LAYER = "application/vnd.ollama.image.projector"
# [HOST/][NAMESPACE/...]MODEL[:TAG]; a host has a dot (hf.co, registry.ollama.ai).
_NAME = re.compile(
    r"^(?:(?P<host>[\w-]+(?:\.[\w-]+)+(?::\d+)?)/)?(?:(?P<path>[\w.-]+(?:/[\w.-]+)*)/)?"
    r"(?P<model>[\w.-]+)(?::(?P<tag>[\w.-]+))?$"
)
# The Modelfile's PARAMETERs that are sampling defaults, by generation_config.json's names
# (SamplingDefaults.with_overrides).
_SAMPLING = {"temperature": "temperature", "top_k": "top_k", "top_p": "top_p",
             "min_p": "min_p", "repeat_penalty": "repetition_penalty"}  # fmt: skip


@dataclass(frozen=True)
class OllamaModel:
    gguf: Path  # the model layer's blob
    name: str  # as named, e.g. "llama3.2:3b"
    sampling: dict[str, Any] = field(default_factory=dict)  # generation_config.json's names
    projector: Path | None = None  # its projector layer's blob (a vision projector file)


def ollama_model_dirs() -> list[Path]:
    """Where Ollama keeps its models, in the order it is looked for."""
    if configured := os.environ.get("OLLAMA_MODELS"):
        return [Path(configured).expanduser()]
    return [Path.home() / ".ollama" / "models", Path("/usr/share/ollama/.ollama/models")]


def find_ollama_model(spec: str) -> OllamaModel | None:
    """The model Ollama pulled under the name `spec`, or None where no manifest names it;
    ModelLoadError where one does but its GGUF is not there."""
    match = _NAME.match(spec)
    if match is None:
        return None
    host = match["host"] or DEFAULT_HOST
    namespace = match["path"] or "library"
    tag = match["tag"] or "latest"
    for root in ollama_model_dirs():
        manifest = root / "manifests" / host / namespace / match["model"] / tag
        if manifest.is_file():
            return _read(root, manifest, spec)
    return None


def _read(root: Path, manifest: Path, spec: str) -> OllamaModel:
    try:
        layers = json.loads(manifest.read_text())["layers"]
        digests = {layer["mediaType"]: layer["digest"] for layer in layers}
    except (OSError, ValueError, KeyError, TypeError) as error:
        raise ModelLoadError(f"Ollama's manifest {manifest} cannot be read: {error}") from None
    if _MODEL_LAYER not in digests:
        raise ModelLoadError(f"Ollama's manifest {manifest} names no model layer")
    gguf = _blob(root, digests[_MODEL_LAYER])
    if not gguf.is_file():
        raise ModelLoadError(
            f"Ollama's model {spec!r} has no GGUF at {gguf} (a pull left unfinished?): "
            f"`ollama pull {spec}` again"
        )
    sampling: dict[str, Any] = {}
    if _PARAMS_LAYER in digests:
        params = _blob(root, digests[_PARAMS_LAYER])
        try:
            given = json.loads(params.read_text())
        except (OSError, ValueError):
            given = {}
        if isinstance(given, dict):
            sampling = {_SAMPLING[k]: v for k, v in given.items() if k in _SAMPLING}
    projector = _blob(root, digests[_PROJECTOR_LAYER]) if _PROJECTOR_LAYER in digests else None
    return OllamaModel(
        gguf, spec, sampling, projector if projector and projector.is_file() else None
    )


def _blob(root: Path, digest: str) -> Path:
    return root / "blobs" / digest.replace(":", "-")
