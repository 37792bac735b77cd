"""Ollama's model store laid out as `ollama pull` leaves it, for tests of naming a model as
Ollama names it: blobs/sha256-HEX by content, and a manifest at
manifests/HOST/NAMESPACE/MODEL/TAG naming its layers by digest and media type."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path


def _blob(root: Path, data: bytes) -> dict[str, object]:
    digest = "sha256:" + hashlib.sha256(data).hexdigest()
    (root / "blobs").mkdir(parents=True, exist_ok=True)
    (root / "blobs" / digest.replace(":", "-")).write_bytes(data)
    return {"digest": digest, "size": len(data)}


def pull(
    root: Path,
    name: str,
    gguf: Path,
    params: dict[str, object] | None = None,
    projector: Path | None = None,
) -> None:
    """What `ollama pull` leaves for `name` (HOST/NAMESPACE/MODEL/TAG): the model layer, a
    template, the Modelfile's PARAMETERs if given, a vision projector layer if given."""
    host, namespace, model, tag = name.split("/")
    layers = [{"mediaType": "application/vnd.ollama.image.model", **_blob(root, gguf.read_bytes())},
              {"mediaType": "application/vnd.ollama.image.template", **_blob(root, b"{{ .Prompt }}")}]  # fmt: skip
    if params is not None:
        layers.append({"mediaType": "application/vnd.ollama.image.params",
                       **_blob(root, json.dumps(params).encode())})  # fmt: skip
    if projector is not None:
        layers.append({"mediaType": "application/vnd.ollama.image.projector",
                       **_blob(root, projector.read_bytes())})  # fmt: skip
    manifest = root / "manifests" / host / namespace / model / tag
    manifest.parent.mkdir(parents=True, exist_ok=True)
    manifest.write_text(json.dumps({"schemaVersion": 2, "layers": layers}))
