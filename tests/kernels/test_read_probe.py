"""The kernels' `read_probe` (csrc/read_probe.cpp), the read that `iterserve.bench.bandwidth`
times beside torch's sum: every whole 64-byte line of the buffer is read, whatever the number
of threads and however the lines split into a thread's 4 streams and the lines left over; a
last partial line is not."""

from __future__ import annotations

import pytest
import torch

from iterserve import kernels

pytestmark = pytest.mark.usefixtures("any_kernel_isa")

LINES = 1003  # 4 streams a thread leave lines over for 1, 2 and 3 threads


@pytest.mark.parametrize("threads", [1, 2, 3])
def test_every_whole_line_is_read(threads: int) -> None:
    probe = kernels.ops().read_probe
    buffer = torch.zeros(LINES * 64 + 37, dtype=torch.uint8)
    assert probe(buffer, threads) == 0
    for line in range(LINES):
        buffer.zero_()
        buffer[line * 64 + 5] = 0x81  # byte 1 of the line's second int32
        assert probe(buffer, threads) == 0x8100, f"line {line}"


def test_the_last_partial_line_is_left() -> None:
    buffer = torch.zeros(3 * 64 + 37, dtype=torch.uint8)
    buffer[-1] = 0xFF
    assert kernels.ops().read_probe(buffer, 2) == 0
