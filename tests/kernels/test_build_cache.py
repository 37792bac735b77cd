"""The kernels' build cache survives a build that was killed mid-way."""

from __future__ import annotations

import subprocess
import sys

import pytest

from iterserve import kernels


@pytest.mark.slow
def test_a_baton_left_by_a_killed_build_does_not_block_later_loads() -> None:
    variant = kernels.describe()
    if variant is None or kernels.why_unavailable() is not None:
        pytest.skip(f"no kernels to build here: {kernels.why_unavailable()}")
    assert kernels.available()  # built (or loaded) once
    build_dir = kernels.build_directory(variant)
    (build_dir / "built.ok").unlink()  # as if the build had not finished
    baton = build_dir / "lock"
    baton.touch()  # what torch's builder leaves when its process is killed mid-build
    load = "from iterserve import kernels; print(kernels.available())"
    result = subprocess.run(
        [sys.executable, "-c", load], capture_output=True, text=True, timeout=300
    )
    assert result.stdout.strip() == "True", result.stderr
    assert not baton.exists()
    assert (build_dir / "built.ok").exists()  # later loads take the library as it is
