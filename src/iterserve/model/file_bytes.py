"""A file's bytes read where they are, into memory of their own: how checkpoints are read
(GGUF's blocks, model/gguf_blocks.py; safetensors' tensors, model/safetensors_file.py).
Not through a mapping: a mapped file's touched pages stay in the process's resident set
until it is unmapped, so a load would hold the file beside what it built from it.

- A load reads its quantized tensors a slice at a time into one buffer (`SliceReader`),
  which each slice's repack consumes before the next is read. A fresh buffer a slice had the
  kernel find and zero new pages for every slice: as many bytes as the file again.
- Bytes the page cache does not hold are read straight from the disk (`O_DIRECT`), as
  llama.cpp's `--direct-io` reads them. Through the page cache the kernel fills a page of
  its own for every page of the file, copies it out, and keeps the file cached after the
  load beside the weights built from it. Bytes it holds (a file read a moment ago, a test's
  tiny file) are copied from it. A file system that refuses direct reads is read through it.
- A direct read lands in a buffer aligned as the file's offset is within a 4 KiB block
  (GGUF aligns its tensors to 32 bytes, safetensors to 8).
- While a mixture of experts' stacks are read (an expert's slice of ~1 MB at a time, in
  the file's order: `SliceReader.reading_ahead`), one read of `_WINDOW_BYTES` serves the
  next slices from its buffer, where each slice read on its own waited on the disk once
  more. Only there: a dense model's tensors are read in the network's order, not the
  file's, and reads ahead of them were mostly read again (a 3B's load 3.8 -> 5-9 s).

Measured on an 8B Q4_K_M: docs/benchmarks.md, "Loading from a cold page cache".
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import mmap
import os
from collections.abc import Iterator
from contextvars import ContextVar
from pathlib import Path

import numpy as np

# O_DIRECT's transfers start, end and land on multiples of this (the logical block size of
# the devices people use is 512 or 4096).
_DIRECT_ALIGN = 4096
# A slice is read through the page cache when at least this share of its pages is there.
_CACHED_SHARE = 0.5
# A load's reads smaller than this that go forward through a file are served from one
# read of this many bytes (`SliceReader`'s read-ahead): the size of a large tensor's slice.
_WINDOW_BYTES = 64 << 20


def read_bytes(path: Path, offset: int, nbytes: int) -> np.ndarray:
    """`nbytes` of the file from `offset`, as a writable uint8 array of its own (read as a
    load's slices are: from the disk where the page cache does not hold them)."""
    reader = SliceReader()
    try:
        return reader.read(path, offset, nbytes)  # a view of the reader's buffer, now its own
    finally:
        reader.close()


def _read_fully(
    fd: int, path: Path, offset: int, view: memoryview, need: int | None = None
) -> None:
    """Fills `view` from the file at `offset` (or at least its first `need` bytes: a direct
    read past the file's end stops at it)."""
    need = len(view) if need is None else need
    done = 0
    while done < need:
        count = os.preadv(fd, [view[done:]], offset + done)
        if not count:
            raise OSError(f"{path}: ended {need - done} bytes early at offset {offset + done}")
        done += count


class SliceReader:
    """A load's reads of large tensors, a slice at a time, into one buffer: `read` returns a
    view of it that the next read overwrites. Files stay open until `close`. While
    `reading_ahead`, a small read that starts at or past the previous one's start reads
    `_WINDOW_BYTES` from its offset, and the reads that fall within serve from them."""

    def __init__(self) -> None:
        self._buffer = np.empty(0, dtype=np.uint8)
        self._files: dict[Path, _OpenFile] = {}
        self._read_ahead = False
        # The bytes read ahead: their file, their offset, and themselves (a buffer view).
        self._window: tuple[Path, int, np.ndarray] | None = None

    def read(self, path: Path, offset: int, nbytes: int) -> np.ndarray:
        """`nbytes` of the file from `offset`, as a uint8 view valid until the next read."""
        window = self._window
        if window is not None and window[0] == path:
            start = offset - window[1]
            if start >= 0 and start + nbytes <= len(window[2]):
                return window[2][start : start + nbytes]
        self._window = None
        file = self._files.get(path)
        if file is None:
            file = self._files[path] = _OpenFile(path)
        forward = window is not None and window[0] == path and offset >= window[1]
        if self._read_ahead and nbytes < _WINDOW_BYTES and (window is None or forward):
            ahead = min(_WINDOW_BYTES, file.size - offset)
            data = self._read(file, path, offset, max(ahead, nbytes))
            self._window = (path, offset, data)
            return data[:nbytes]
        return self._read(file, path, offset, nbytes)

    @contextlib.contextmanager
    def reading_ahead(self) -> Iterator[None]:
        """Within, small reads going forward through a file are served from reads ahead."""
        before, self._read_ahead = self._read_ahead, True
        try:
            yield
        finally:
            self._read_ahead = before
            self._window = None

    def _read(self, file: _OpenFile, path: Path, offset: int, nbytes: int) -> np.ndarray:
        if file.direct is not None and not file.cached(offset, nbytes):
            start = offset - offset % _DIRECT_ALIGN
            end = -(-(offset + nbytes) // _DIRECT_ALIGN) * _DIRECT_ALIGN
            buffer = self._aligned(end - start)
            try:
                _read_fully(file.direct, path, start, memoryview(buffer), offset + nbytes - start)
                return buffer[offset - start : offset - start + nbytes]
            except OSError as error:
                if error.errno is None:  # the file ended early: not the flag's doing
                    raise
                file.stop_direct()  # a file system that takes the flag but not the reads
        buffer = self._aligned(nbytes)
        _read_fully(file.fd, path, offset, memoryview(buffer))
        return buffer

    def close(self) -> None:
        for file in self._files.values():
            file.close()
        self._files.clear()
        self._window = None
        self._buffer = np.empty(0, dtype=np.uint8)

    def _aligned(self, nbytes: int) -> np.ndarray:
        """The buffer's first `nbytes`, from an O_DIRECT-aligned address; grown as needed."""
        if self._buffer.size < nbytes + _DIRECT_ALIGN:
            self._buffer = np.empty(nbytes + _DIRECT_ALIGN, dtype=np.uint8)
        start = -self._buffer.ctypes.data % _DIRECT_ALIGN
        return self._buffer[start : start + nbytes]


class _OpenFile:
    """A file open for reads through the page cache, and where the system allows, for reads
    around it."""

    def __init__(self, path: Path) -> None:
        self.fd = os.open(path, os.O_RDONLY)
        self.size = os.fstat(self.fd).st_size
        self.direct: int | None = None
        direct_flag = getattr(os, "O_DIRECT", 0)
        if direct_flag and _libc() is not None:
            with contextlib.suppress(OSError):  # tmpfs and some others refuse the flag
                self.direct = os.open(path, os.O_RDONLY | direct_flag)

    def cached(self, offset: int, nbytes: int) -> bool:
        return _resident_share(self.fd, offset, nbytes) >= _CACHED_SHARE

    def stop_direct(self) -> None:
        if self.direct is not None:
            os.close(self.direct)
            self.direct = None

    def close(self) -> None:
        self.stop_direct()
        os.close(self.fd)


@functools.cache
def _libc() -> ctypes.CDLL | None:
    """The C library's mmap, munmap and mincore, or None where there are none."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.mmap.restype = ctypes.c_void_p
        libc.mmap.argtypes = (
            ctypes.c_void_p,
            ctypes.c_size_t,
            ctypes.c_int,
            ctypes.c_int,
            ctypes.c_int,
            ctypes.c_long,
        )
        libc.munmap.argtypes = (ctypes.c_void_p, ctypes.c_size_t)
        libc.mincore.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_char_p)
    except (OSError, AttributeError):
        return None
    return libc


def _resident_share(fd: int, offset: int, nbytes: int) -> float:
    """The share of the file's pages in [offset, offset + nbytes) that the page cache holds
    (mincore on a mapping that is never touched); 1 where it cannot be asked."""
    libc = _libc()
    page = os.sysconf("SC_PAGE_SIZE")
    start = offset - offset % page
    length = offset + nbytes - start
    if libc is None or length <= 0:
        return 1.0
    address = libc.mmap(None, length, mmap.PROT_READ, mmap.MAP_SHARED, fd, start)
    if address in (None, ctypes.c_void_p(-1).value):
        return 1.0
    try:
        pages = -(-length // page)
        resident = ctypes.create_string_buffer(pages)
        if libc.mincore(address, length, resident) != 0:
            return 1.0
        flags = np.frombuffer(resident.raw, dtype=np.uint8)
        return float(np.count_nonzero(flags & 1)) / pages
    finally:
        libc.munmap(address, length)


_READER: ContextVar[SliceReader | None] = ContextVar("iterserve_slice_reader", default=None)


@contextlib.contextmanager
def shared_slice_reader() -> Iterator[None]:
    """Within, `slice_reader` gives every caller the same reader (a model's load)."""
    reader = SliceReader()
    token = _READER.set(reader)
    try:
        yield
    finally:
        _READER.reset(token)
        reader.close()


@contextlib.contextmanager
def slice_reader() -> Iterator[SliceReader]:
    """The load's reader, or one of its own for a read outside a load."""
    shared = _READER.get()
    if shared is not None:
        yield shared
        return
    reader = SliceReader()
    try:
        yield reader
    finally:
        reader.close()
