"""Where the model a user names lies: a path, the bundled model, a repository already in
the local Hugging Face cache, or a model Ollama has pulled (model/ollama_store.py).

`vllm serve Qwen/Qwen3-8B` finds a checkpoint that `hf download` put in the cache, and
llama.cpp's `-hf bartowski/Llama-3.2-1B-Instruct-GGUF:Q4_K_M` picks one quantization of a
GGUF repository by its tag. iterserve takes both forms, but never downloads: a repository
that is not in the cache is an error saying how to fetch it. The cache is the hub's own
layout (`models--OWNER--NAME/refs/main` names a commit, `snapshots/COMMIT/` holds the files
downloaded so far, as links into `blobs/`), found where huggingface_hub finds it (HF_HUB_CACHE,
HF_HOME, ~/.cache/huggingface/hub).

Names and the cache's refs only: no model file is opened here (the loaders read them).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from iterserve.model.bundled import default_model_path
from iterserve.model.errors import ModelLoadError
from iterserve.model.gguf_parts import part_number
from iterserve.model.ollama_store import find_ollama_model, ollama_model_dirs

# OWNER/NAME, optionally :TAG (a quantization, llama.cpp's `-hf` form). Hub names are letters,
# digits, '-', '_' and '.'.
_REPO_ID = re.compile(r"^(?P<repo>[\w.-]+/[\w.-]+)(?::(?P<tag>[\w.-]+))?$")
# llama.cpp's choice when a GGUF repository is named without a tag.
DEFAULT_GGUF_TAG = "Q4_K_M"
# Files beside a GGUF model that are not one: a vision model's projector.
_NOT_A_MODEL = re.compile(r"^mmproj", re.IGNORECASE)
_QUANT_TAG = re.compile(
    r"(?:^|[-._])((?:UD-)?(?:I?Q\d\w*|[BF]F?16|F32))(?:-\d{5}-of-\d{5})?$", re.IGNORECASE
)


@dataclass(frozen=True)
class ModelSource:
    path: Path  # an HF directory or a GGUF file (a split model's first part)
    name: str | None = None  # the repository as the user named it; None for a path
    # Sampling settings that come with it, by generation_config.json's names (an Ollama
    # model's Modelfile PARAMETERs), over the checkpoint's own.
    sampling: dict[str, Any] = field(default_factory=dict)
    # Its vision projector file, where one comes with it: an mmproj GGUF beside a GGUF model
    # in its repository (what llama-server's -hf takes with --mmproj-auto), or an Ollama
    # model's projector layer.
    projector: Path | None = None


def find_model(spec: str | Path | None, revision: str | None = None) -> ModelSource:
    """The model `spec` names: None is the bundled model; an existing path is itself; else
    OWNER/NAME[:TAG] in the local Hugging Face cache, at `revision` (a branch, tag or commit
    the cache holds; None: main); else a model Ollama pulled under that name
    (`llama3.2:3b`). ModelLoadError saying what was looked for where, and how to get it,
    otherwise."""
    if spec is None:
        return ModelSource(default_model_path())
    path = Path(spec).expanduser()
    if path.exists():
        return ModelSource(path)
    match = _REPO_ID.match(str(spec))
    if match is None:
        if (pulled := _pulled(spec, revision)) is not None:
            return pulled
        where = ", ".join(str(d) for d in ollama_model_dirs())
        raise ModelLoadError(
            f"model path {str(spec)!r} does not exist, and no model Ollama pulled has that "
            f"name ({where}); iterserve never downloads: pass a local directory or .gguf "
            "file, a repository already in the Hugging Face cache, or a model `ollama pull` "
            "fetched"
        )
    repo, tag = match["repo"], match["tag"]
    try:
        snapshot = _snapshot(repo, str(spec), revision)
    except ModelLoadError:  # not in the Hugging Face cache: one Ollama pulled, if any
        if (pulled := _pulled(spec, revision)) is None:
            raise
        return pulled
    model = _model_in(snapshot, repo, tag)
    projector = _projector_in(snapshot) if model.suffix == ".gguf" else None
    return ModelSource(model, str(spec), projector=projector)


def _pulled(spec: str | Path, revision: str | None) -> ModelSource | None:
    """The model Ollama pulled under the name `spec` (Ollama's names have no revision)."""
    pulled = find_ollama_model(str(spec)) if revision is None else None
    if pulled is None:
        return None
    return ModelSource(pulled.gguf, pulled.name, pulled.sampling, pulled.projector)


def find_adapter(spec: str | Path) -> Path:
    """A LoRA adapter's path: `spec` itself if it exists (or names no repository: the
    adapter's loader says what is wrong with it), else OWNER/NAME[:TAG] in the local Hugging
    Face cache, a PEFT repository's snapshot or its GGUF adapter; ModelLoadError if it is
    not there."""
    path = Path(spec).expanduser()
    match = _REPO_ID.match(str(spec))
    if path.exists() or match is None:
        return path
    snapshot = _snapshot(match["repo"], str(spec))
    if match["tag"] is None and (snapshot / "adapter_config.json").is_file():
        return snapshot
    return _model_in(snapshot, match["repo"], match["tag"])


def hub_cache() -> Path:
    """The hub cache huggingface_hub uses (its environment variables read at its import)."""
    from huggingface_hub import constants

    return Path(constants.HF_HUB_CACHE)


def _snapshot(repo: str, spec: str, revision: str | None = None) -> Path:
    """The cached snapshot of `repo` at `revision`: the commit refs/REVISION names, or the
    snapshot of that commit; without one, refs/main's (the only snapshot, without a ref)."""
    cache = hub_cache()
    folder = cache / ("models--" + repo.replace("/", "--"))
    snapshots = sorted(p for p in (folder / "snapshots").glob("*") if p.is_dir())
    if not snapshots:
        raise ModelLoadError(
            f"model {spec!r} is neither a local path nor a repository in the Hugging Face "
            f"cache ({cache}); iterserve never downloads: fetch it first, e.g. `hf download "
            f"{repo}` (a GGUF repository: `hf download {repo} --include '*Q4_K_M*'`)"
        )
    ref = folder / "refs" / (revision or "main")
    if ref.is_file():
        commit = ref.read_text().strip()
        if (folder / "snapshots" / commit).is_dir():
            return folder / "snapshots" / commit
    if revision is not None:
        if (folder / "snapshots" / revision).is_dir():
            return folder / "snapshots" / revision
        refs = sorted(p.name for p in (folder / "refs").glob("*"))
        raise ModelLoadError(
            f"model {spec!r}: revision {revision!r} is not in the Hugging Face cache (it holds "
            f"refs {', '.join(refs) or 'none'} and commits "
            f"{', '.join(p.name[:12] for p in snapshots)}); fetch it with `hf download {repo} "
            f"--revision {revision}`"
        )
    if len(snapshots) == 1:
        return snapshots[0]
    raise ModelLoadError(
        f"model {spec!r}: the Hugging Face cache holds {len(snapshots)} snapshots of {repo} "
        f"({', '.join(p.name[:12] for p in snapshots)}) and no refs/main naming one; pass the "
        "snapshot's directory as the model"
    )


def _model_in(snapshot: Path, repo: str, tag: str | None) -> Path:
    """The HF directory or the GGUF model (by its tag; without one, the only GGUF model or
    the one llama.cpp would take) a snapshot holds."""
    if tag is None and (snapshot / "config.json").is_file():
        return snapshot
    models = _gguf_models(snapshot)
    wanted = tag or DEFAULT_GGUF_TAG
    if tag is None and len(models) == 1:
        return models[0]
    chosen = [p for p in models if (quant_tag(p) or "").upper() == wanted.upper()]
    if len(chosen) == 1:
        return chosen[0]
    where = f"{repo} in the Hugging Face cache ({snapshot})"
    if not models:
        raise ModelLoadError(
            f"{where} holds neither a config.json nor a GGUF model: fetch its files first "
            f"(`hf download {repo}`)"
        )
    if chosen:
        paths = ", ".join(str(p.relative_to(snapshot)) for p in chosen)
        raise ModelLoadError(
            f"{where} holds {len(chosen)} GGUF models tagged {wanted} "
            f"({paths}): pass the path of the one to serve"
        )
    tags = ", ".join(sorted({quant_tag(p) or p.name for p in models}))
    raise ModelLoadError(
        f"{where} holds no GGUF model tagged {wanted} (it holds {tags}): name one as {repo}:TAG"
    )


# Of several projector files in a repository, the one taken: F16 first, as llama.cpp's
# converter writes them by default, then the other full-precision ones.
_PROJECTOR_PREFERENCE = ("F16", "BF16", "F32")


def _projector_in(snapshot: Path) -> Path | None:
    """The vision projector file (`mmproj*.gguf`) a GGUF repository's snapshot holds, if
    any: the only one, or the first by _PROJECTOR_PREFERENCE, or by name."""
    found = sorted(p for p in snapshot.rglob("*.gguf") if _NOT_A_MODEL.match(p.name))

    def rank(path: Path) -> int:
        tag = (quant_tag(path) or "").upper()
        preferred = _PROJECTOR_PREFERENCE
        return preferred.index(tag) if tag in preferred else len(preferred)

    return min(found, key=rank) if found else None


def _gguf_models(snapshot: Path) -> list[Path]:
    """The GGUF models among a snapshot's files, its folders too (large quantizations often
    sit in one of their own): whole files, and split models by their first parts."""
    found = []
    for path in sorted(snapshot.rglob("*.gguf")):
        number = part_number(path)
        if _NOT_A_MODEL.match(path.name) or (number is not None and number[0] != 1):
            continue
        found.append(path)
    return found


def quant_tag(path: Path) -> str | None:
    """The quantization a GGUF's name ends in, as hubs name them ("Q4_K_M", "IQ4_XS",
    "UD-Q4_K_XL", "BF16"), or None."""
    match = _QUANT_TAG.search(path.name.removesuffix(".gguf"))
    return match[1] if match else None
