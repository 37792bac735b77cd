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
    get ordinary memory.

    The tiles start on a 2 MiB boundary of a mapping one huge page longer than they are:
    Linux gives huge pages only to whole aligned 2 MiB ranges, and a mapping starts on any
    4 KiB one, so a buffer mapped at its own size lost up to a huge page at each end to 4 KiB
    pages (a Llama 3.2 3B Q4_K_M's tiles, 1.7 GB: 19% of them). The slack before the start is
    never touched, so it holds no memory; the part-page at the end stays on 4 KiB pages
    rather than hold up to 2 MiB more than the tiles need."""
    size = rows * row_bytes
    advice = getattr(mmap, "MADV_HUGEPAGE", None)
    if size < _HUGE_PAGE or advice is None:
        return torch.empty((rows, row_bytes), dtype=torch.uint8)
    region = mmap.mmap(-1, size + _HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    # The tensor holds the mapping (an exported buffer) and unmaps it when freed.
    whole = torch.frombuffer(region, dtype=torch.uint8)
    start = -whole.data_ptr() % _HUGE_PAGE
    huge = size // _HUGE_PAGE * _HUGE_PAGE
    with contextlib.suppress(OSError):  # a kernel built without transparent huge pages
        region.madvise(advice, start, huge)
        no_huge = getattr(mmap, "MADV_NOHUGEPAGE", None)
        if no_huge is not None:  # under the `always` mode too
            region.madvise(no_huge, start + huge, len(region) - start - huge)
    return whole[start : start + size].view(rows, row_bytes)


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
