"""The kernels' build cache survives a build that was killed mid-way."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from iterserve import kernels


@pytest.mark.slow
def test_a_baton_left_by_a_killed_build_does_not_block_later_loads(tmp_path: Path) -> None:
    variant = kernels.describe()
    if variant is None or kernels.why_unavailable() is not None:
        pytest.skip(f"no kernels to build here: {kernels.why_unavailable()}")
    assert kernels.available()  # built (or loaded) once
    # A copy of the build in a cache of this test's own: other processes (pytest's other
    # worker) load from the shared one meanwhile, and their loads must not see it broken.
    shared = kernels.build_directory(variant)
    build_dir = tmp_path / "kernels" / shared.name
    shutil.copytree(shared, build_dir)  # mtimes kept: ninja finds nothing to do
    (build_dir / "built.ok").unlink()  # as if the build had not finished
    baton = build_dir / "lock"
    baton.touch()  # what torch's builder leaves when its process is killed mid-build
    load = "from iterserve import kernels; print(kernels.available())"
    result = subprocess.run(
        [sys.executable, "-c", load],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "ITERSERVE_CACHE_DIR": str(tmp_path)},
    )
    assert result.stdout.strip() == "True", result.stderr
    assert not baton.exists()
    assert (build_dir / "built.ok").exists()  # later loads take the library as it is
