"""The kernels' build cache survives a build that was killed mid-way; a build compiles
every source once.

The kernels are built by `kernels.build_and_load_library`; here it builds a one-function
library of the test's own, in a directory of the test's own: the same locking, baton and
finished-build marker as the kernels' build, without recompiling the kernels (a copy of
their build is recompiled in full when its ninja file names another checkout's sources) and
without touching the shared cache other processes load from."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from iterserve import kernels

SOURCE = 'extern "C" int iterserve_baton_check() { return 7; }\n'
LOAD = """
import logging
import sys
from pathlib import Path
from iterserve import kernels
logging.basicConfig(level=logging.INFO)
source, build_dir = sys.argv[1], Path(sys.argv[2])
kernels.build_and_load_library("baton_check", [source], ["-O1"], build_dir, [])
print("loaded")
"""


def _load(source: Path, build_dir: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-c", LOAD, str(source), str(build_dir)],
        capture_output=True,
        text=True,
        timeout=300,
    )


@pytest.mark.slow
def test_a_baton_left_by_a_killed_build_does_not_block_later_loads(tmp_path: Path) -> None:
    if shutil.which("c++") is None:
        pytest.skip(f"no compiler to build with: {kernels.why_unavailable()}")
    source = tmp_path / "baton_check.cpp"
    source.write_text(SOURCE)
    build_dir = tmp_path / "build"
    first = _load(source, build_dir)
    assert first.stdout.strip() == "loaded", first.stderr
    # A first start says what it is waiting for.
    assert (
        f"building baton_check (once for this source tree; cached in {build_dir})" in first.stderr
    )
    assert "built baton_check in" in first.stderr
    assert (build_dir / "built.ok").exists()
    # As if the build had been killed before it finished: no marker, and torch's baton (a
    # plain file its builder leaves when its process dies) still there.
    (build_dir / "built.ok").unlink()
    baton = build_dir / "lock"
    baton.touch()
    second = _load(source, build_dir)  # waited on the baton for ever before
    assert second.stdout.strip() == "loaded", second.stderr
    assert not baton.exists()
    assert (build_dir / "built.ok").exists()
    # A finished build is loaded as it is: no ninja run, so no source or build file needed.
    source.unlink()
    (build_dir / "build.ninja").unlink()
    third = _load(source, build_dir)
    assert third.stdout.strip() == "loaded", third.stderr
    assert "building" not in third.stderr


def test_a_build_compiles_every_source_once(tmp_path: Path) -> None:
    units = kernels.compile_units(tmp_path)
    *own, others = units
    included = others.read_text().split('"')[1::2]  # #include "name.cpp" lines
    compiled = [p.name for p in own] + included
    assert sorted(compiled) == sorted(p.name for p in kernels.sources())
    assert own == kernels.sources()[: len(own)]  # the longest on their own, started first
    # Written once: an unchanged unit keeps its time, so ninja does not recompile it.
    written = others.stat().st_mtime_ns
    assert kernels.compile_units(tmp_path) == units
    assert others.stat().st_mtime_ns == written
