"""A Hugging Face hub cache laid out as `hf download` leaves it, for tests of naming a model by
its repository: models--OWNER--NAME/refs/main names a commit; snapshots/COMMIT/ holds the
downloaded files as relative links into blobs/ (here the blobs link to the test's files)."""

from __future__ import annotations

import hashlib
import os
from collections.abc import Mapping
from pathlib import Path

COMMIT = "0123456789abcdef0123456789abcdef01234567"


def cache_repo(
    cache: Path, repo: str, files: Mapping[str, Path], commit: str = COMMIT, ref: bool = True
) -> Path:
    """Put `files` ({path in the repository: file}) in `cache` as `repo`'s snapshot `commit`,
    refs/main naming it unless `ref` is False; the snapshot's directory."""
    folder = cache / ("models--" + repo.replace("/", "--"))
    snapshot = folder / "snapshots" / commit
    for name, source in files.items():
        blob = folder / "blobs" / hashlib.sha256(f"{commit}/{name}".encode()).hexdigest()
        blob.parent.mkdir(parents=True, exist_ok=True)
        blob.symlink_to(source.resolve())
        link = snapshot / name
        link.parent.mkdir(parents=True, exist_ok=True)
        link.symlink_to(os.path.relpath(blob, link.parent))
    if ref:
        (folder / "refs").mkdir(exist_ok=True)
        (folder / "refs" / "main").write_text(commit)
    return snapshot
