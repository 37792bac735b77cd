"""A load's reads (model/file_bytes.py): every byte where the file has it, whether a slice
comes through the page cache or straight from the disk, and whether the file system takes
direct reads or not; a model's tiles are the same bits either way."""

from __future__ import annotations

import errno
import os
from pathlib import Path

import numpy as np
import pytest
import torch

from iterserve import kernels
from iterserve.model import file_bytes
from iterserve.model.file_bytes import SliceReader, read_bytes, shared_slice_reader
from iterserve.model.loader import load_model

# Ranges that start and end on and off the 4 KiB boundaries a direct read keeps, and run to
# the file's very end (a direct read there returns less than it asked for).
SIZE = 3 * 65536 + 123
RANGES = [
    (0, 4096),
    (1, 5000),
    (4095, 2),
    (8192, 65536),
    (70001, 99999),
    (SIZE - 7, 7),
    (0, SIZE),
    (SIZE - 70000, 70000),
]


@pytest.fixture
def data_file(tmp_path: Path) -> tuple[Path, bytes]:
    data = np.random.default_rng(0).integers(0, 256, SIZE, dtype=np.uint8).tobytes()
    path = tmp_path / "blob.bin"
    path.write_bytes(data)
    return path, data


def _pages_cached(monkeypatch: pytest.MonkeyPatch, share: float) -> None:
    """Every slice as if the page cache held this share of its pages."""
    monkeypatch.setattr(file_bytes, "_resident_share", lambda *args: share)


@pytest.mark.parametrize("cached", [0.0, 1.0], ids=["from-disk", "from-page-cache"])
def test_a_slice_is_the_files_bytes(
    data_file: tuple[Path, bytes], monkeypatch: pytest.MonkeyPatch, cached: float
) -> None:
    path, data = data_file
    _pages_cached(monkeypatch, cached)
    reader = SliceReader()
    try:
        for offset, nbytes in RANGES:
            got = reader.read(path, offset, nbytes)
            assert got.tobytes() == data[offset : offset + nbytes], (offset, nbytes)
            assert read_bytes(path, offset, nbytes).tobytes() == data[offset : offset + nbytes]
    finally:
        reader.close()


@pytest.mark.parametrize("cached", [0.0, 1.0], ids=["from-disk", "from-page-cache"])
def test_a_reader_reading_ahead_serves_forward_reads_from_one_read(
    data_file: tuple[Path, bytes], monkeypatch: pytest.MonkeyPatch, cached: float
) -> None:
    """A load's reader reading ahead (as an expert stack's slices are read): small slices
    going forward through the file come from one read of the window; one going back or past the
    window reads again; every slice is the file's bytes, whichever way it came."""
    path, data = data_file
    _pages_cached(monkeypatch, cached)
    monkeypatch.setattr(file_bytes, "_WINDOW_BYTES", 65536)
    reads = []
    preadv = os.preadv
    monkeypatch.setattr(
        file_bytes.os,
        "preadv",
        lambda fd, views, offset: reads.append(offset) or preadv(fd, views, offset),
    )
    slices = [(100, 1000), (1100, 3000), (9000, 50000), (70000, 8), (60000, 10), (SIZE - 5, 5)]
    with shared_slice_reader(), file_bytes.slice_reader() as reader, reader.reading_ahead():
        got = [reader.read(path, offset, nbytes).tobytes() for offset, nbytes in slices]
    assert got == [data[offset : offset + nbytes] for offset, nbytes in slices]
    # The first three in one window of 64 KiB from 100; 70000 past it (a new window, forward),
    # 60000 behind it (read alone), the last from a window of its own (the file's end).
    assert len(reads) == 4
    with file_bytes.slice_reader() as plain:  # not reading ahead: reads what it is asked
        plain.read(path, 100, 1000)
        plain.read(path, 1100, 3000)
    assert len(reads) == 6


def test_a_file_system_refusing_direct_reads_is_read_through_the_cache(
    data_file: tuple[Path, bytes], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Some file systems open with O_DIRECT and then fail its reads (EINVAL): the reader
    reads that file through the page cache from then on, and loses nothing."""
    path, data = data_file
    _pages_cached(monkeypatch, 0.0)
    real_preadv = os.preadv
    direct_fds: set[int] = set()
    real_open = os.open

    def tracking_open(p: object, flags: int, *args: object) -> int:
        fd = real_open(p, flags, *args)  # type: ignore[arg-type]
        if flags & getattr(os, "O_DIRECT", 0):
            direct_fds.add(fd)
        return fd

    def refusing_preadv(fd: int, buffers: list[memoryview], offset: int) -> int:
        if fd in direct_fds:
            raise OSError(errno.EINVAL, "Invalid argument")
        return real_preadv(fd, buffers, offset)

    monkeypatch.setattr(file_bytes.os, "open", tracking_open)
    monkeypatch.setattr(file_bytes.os, "preadv", refusing_preadv)
    reader = SliceReader()
    try:
        for offset, nbytes in RANGES:
            assert reader.read(path, offset, nbytes).tobytes() == data[offset : offset + nbytes]
        assert reader._files[path].direct is None  # given up after the first refusal
    finally:
        reader.close()


def test_a_file_ending_early_is_an_error_naming_it(data_file: tuple[Path, bytes]) -> None:
    path, _ = data_file
    with pytest.raises(OSError, match="blob.bin: ended 10 bytes early"):
        read_bytes(path, SIZE - 5, 15)


def test_a_file_just_read_is_in_the_page_cache(data_file: tuple[Path, bytes]) -> None:
    """What decides between the two roads: a file read a moment ago is the page cache's."""
    path, _ = data_file
    read_bytes(path, 0, SIZE)
    fd = os.open(path, os.O_RDONLY)
    try:
        assert file_bytes._resident_share(fd, 0, SIZE) == 1.0
        assert file_bytes._resident_share(fd, 5000, 70000) == 1.0
    finally:
        os.close(fd)


@pytest.mark.skipif(not kernels.available(), reason="needs the kernels (a C++ compiler)")
def test_a_models_tiles_are_the_same_bits_from_disk_and_from_the_cache(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The bundled model's every quantized tensor repacked from slices read both ways, within
    one load's shared reader (its buffer reused from tensor to tensor)."""
    ops = kernels.ops()
    loaded = load_model(None)
    assert loaded.quantized

    def all_tiles(cached: float) -> dict[str, torch.Tensor]:
        _pages_cached(monkeypatch, cached)
        with shared_slice_reader():
            return {name: blocks.tiles(ops) for name, blocks in loaded.quantized.items()}

    from_disk, from_cache = all_tiles(0.0), all_tiles(1.0)
    assert from_disk.keys() == from_cache.keys()
    for name in from_disk:
        assert torch.equal(from_disk[name], from_cache[name]), name
