"""A few rows' step walks a thread's tiles in lanes side by side or one after another, by the
CPU (kernels/csrc/tiles.h `few_rows_in_lanes`, read once a process). test_block_formats.py's
few-row tests run here again in child processes, each way forced, so that both ways are
checked on any machine, on every kernel variant the CPU runs."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

BLOCK_FORMAT_TESTS = Path(__file__).with_name("test_block_formats.py")
FEW_ROW_TESTS = "few_rows_step_takes_every_tile_once or products_match_dequantize"


@pytest.mark.slow
@pytest.mark.parametrize("lanes", ["0", "1"])
def test_either_way_of_walking_a_threads_tiles(lanes: str) -> None:
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            "-q",
            "-p",
            "no:cacheprovider",
            "-k",
            FEW_ROW_TESTS,
            str(BLOCK_FORMAT_TESTS),
        ],
        env={**os.environ, "ITERSERVE_LANES": lanes},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-2000:]
    assert " passed" in done.stdout and " failed" not in done.stdout
