"""The kernels' tiles live in their own mappings advised for huge pages (model/host_memory.py)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

from iterserve.model.host_memory import weight_buffer

SMAPS = Path("/proc/self/smaps")


def _vm_flags(address: int) -> list[str]:
    """The VmFlags of the mapping holding `address`."""
    text = SMAPS.read_text()
    for m in re.finditer(r"^([0-9a-f]+)-([0-9a-f]+) .*?^VmFlags:([^\n]*)", text, re.S | re.M):
        if int(m.group(1), 16) <= address < int(m.group(2), 16):
            return m.group(3).split()
    raise AssertionError(f"no mapping holds {address:#x}")


def test_a_large_buffer_is_its_own_mapping_advised_for_huge_pages() -> None:
    if not SMAPS.exists():
        pytest.skip("no /proc/self/smaps here")
    tiles = weight_buffer(64, 64 << 10)  # 4 MiB
    assert tiles.shape == (64, 64 << 10) and tiles.dtype == torch.uint8
    tiles.fill_(7)  # writable, and outlives the mapping object it was made from
    assert int(tiles[-1, -1]) == 7 and int(tiles.sum()) == 7 * tiles.numel()
    assert "hg" in _vm_flags(tiles.data_ptr())  # MADV_HUGEPAGE given


def test_a_large_buffer_starts_on_a_huge_page_and_ends_on_small_ones() -> None:
    """Huge pages cover whole aligned 2 MiB ranges only: the tiles start on one, and the
    part-page at their end is advised against them (it would hold up to 2 MiB unused)."""
    if not SMAPS.exists():
        pytest.skip("no /proc/self/smaps here")
    huge_page = 2 << 20
    tiles = weight_buffer(5, 1 << 20)  # 2.5 huge pages
    tiles.fill_(3)
    assert tiles.data_ptr() % huge_page == 0
    assert int(tiles.sum()) == 3 * tiles.numel()
    assert "hg" in _vm_flags(tiles.data_ptr() + 2 * huge_page - 1)
    assert "nh" in _vm_flags(tiles.data_ptr() + 2 * huge_page)


def test_a_small_buffer_is_ordinary_memory() -> None:
    """torch's own allocation, not a mapping of its own. (Not the VmFlags of the mapping that
    holds it: that is the C heap's, which other code in the process may have advised for huge
    pages; seen once in CI.)"""
    tiles = weight_buffer(4, 1024)
    assert tiles.shape == (4, 1024) and tiles.dtype == torch.uint8
    assert tiles.untyped_storage().resizable()  # torch.empty's; an exported mapping is not
    assert not weight_buffer(64, 64 << 10).untyped_storage().resizable()
