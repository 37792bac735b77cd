"""Host memory for a model's weights: the kernels' tiles on huge pages, and the C heap's
freed pages given back once a load is done."""

from __future__ import annotations

import contextlib
import ctypes
import mmap

import torch

# Below this a tensor gets no mapping of its own: a huge page is 2 MiB.
_HUGE_PAGE = 2 << 20


def weight_buffer(rows: int, row_bytes: int) -> torch.Tensor:
    """An uninitialised [rows, row_bytes] uint8 tensor for a projection's tiles, in its own
    anonymous mapping advised for transparent huge pages (Linux's default `madvise` mode
    gives them only where asked). A decode step streams every weight once: on 4 KiB pages
    that is a TLB walk every 4 KiB, on 2 MiB pages one every 512 (measured:
    benchmarks/linear_kernels.py --pages). Small tensors, and systems without the advice,
    get ordinary memory."""
    size = rows * row_bytes
    advice = getattr(mmap, "MADV_HUGEPAGE", None)
    if size < _HUGE_PAGE or advice is None:
        return torch.empty((rows, row_bytes), dtype=torch.uint8)
    region = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    with contextlib.suppress(OSError):  # a kernel built without transparent huge pages
        region.madvise(advice)
    # The tensor holds the mapping (an exported buffer) and unmaps it when freed.
    return torch.frombuffer(region, dtype=torch.uint8).view(rows, row_bytes)


def release_freed_memory() -> None:
    """Give the C heap's free pages back to the system (glibc's malloc_trim). A load frees
    what it read a slice at a time and the tokenizer's building blocks, but glibc keeps
    freed chunks under its mmap threshold (which grows to 32 MB as large buffers come and go)
    resident for reuse: 30-50 MB held for nothing after a GGUF's load (measured once, the
    bundled tokenizer and a 400 MB file). Elsewhere than glibc, nothing to do."""
    try:
        libc = ctypes.CDLL("libc.so.6")
    except OSError:
        return
    trim = getattr(libc, "malloc_trim", None)
    if trim is not None:
        trim(0)
