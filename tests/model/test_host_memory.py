"""The kernels' tiles live in their own mappings advised for huge pages (model/host_memory.py)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

from iterserve.model import host_memory
from iterserve.model.host_memory import packed_weight_buffers, weight_buffer

SMAPS = Path("/proc/self/smaps")


def _mapping(address: int) -> str:
    """smaps' lines of the mapping holding `address`."""
    text = SMAPS.read_text()
    for m in re.finditer(r"^([0-9a-f]+)-([0-9a-f]+) .*?^VmFlags:[^\n]*", text, re.S | re.M):
        if int(m.group(1), 16) <= address < int(m.group(2), 16):
            return m.group(0)
    raise AssertionError(f"no mapping holds {address:#x}")


def _vm_flags(address: int) -> list[str]:
    """The VmFlags of the mapping holding `address`."""
    return re.search(r"^VmFlags:([^\n]*)", _mapping(address), re.M).group(1).split()  # type: ignore[union-attr]


def _rss(address: int) -> int:
    """Bytes of the mapping holding `address` in memory (smaps' Rss)."""
    return int(re.search(r"^Rss:\s+(\d+) kB", _mapping(address), re.M).group(1)) << 10  # type: ignore[union-attr]


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


def test_a_loads_buffers_lie_back_to_back_on_huge_pages(monkeypatch: pytest.MonkeyPatch) -> None:
    """Within packed_weight_buffers (a model's load) buffers share mappings: one starts where
    the last ended (64-byte aligned), so only a mapping's last part-page is on small pages."""
    if not SMAPS.exists():
        pytest.skip("no /proc/self/smaps here")
    huge_page = 2 << 20
    monkeypatch.setattr(host_memory, "_PACK_BYTES", 16 << 20)  # mappings of 16 MiB
    with packed_weight_buffers():
        first = weight_buffer(3, 1 << 20)  # 3 MiB
        second = weight_buffer(5, 1 << 20)
        big = weight_buffer(10, 1 << 20)  # past the 8 MiB left: a mapping of its own
    outside = weight_buffer(3, 1 << 20)
    assert first.data_ptr() % huge_page == 0
    assert second.data_ptr() == first.data_ptr() + first.numel()
    assert "hg" in _vm_flags(second.data_ptr() + second.numel() - 1)
    assert big.data_ptr() % huge_page == 0 and big.data_ptr() != second.data_ptr() + second.numel()
    assert outside.data_ptr() % huge_page == 0
    for tensor, value in ((first, 1), (second, 2), (big, 3), (outside, 4)):
        tensor.fill_(value)
    assert [int(t[0, 0]) for t in (first, second, big, outside)] == [1, 2, 3, 4]
    assert int(first[-1, -1]) == 1 and int(second[0, 0]) == 2  # neither overwrote the other


def test_a_buffer_is_in_memory_when_made_and_no_more_of_its_mapping() -> None:
    """A load's buffer has its pages faulted in before anything writes it (the threads share
    the zeroing of fresh pages, where a repack left one thread to wait on the other's), and
    only its own pages: the rest of the load's 256 MiB mapping holds nothing."""
    if not SMAPS.exists():
        pytest.skip("no /proc/self/smaps here")
    with packed_weight_buffers():
        tiles = weight_buffer(3, 1 << 20)  # 3 MiB, not written
    rss = _rss(tiles.data_ptr())
    assert 3 << 20 <= rss <= 4 << 20  # on two huge pages, or 768 small ones
