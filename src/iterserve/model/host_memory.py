"""Host memory for a model's weights: the kernels' tiles on huge pages, in memory before they
are written, and the C heap's freed pages given back once a load is done."""

from __future__ import annotations

import contextlib
import ctypes
import mmap
from collections.abc import Iterator
from contextvars import ContextVar

import torch

# Below this a tensor gets no mapping of its own: a huge page is 2 MiB.
_HUGE_PAGE = 2 << 20
_SMALL_PAGE = 4096
# A load packs its buffers into mappings of at least this much (`packed_weight_buffers`).
_PACK_BYTES = 256 << 20


def weight_buffer(rows: int, row_bytes: int) -> torch.Tensor:
    """An uninitialised [rows, row_bytes] uint8 tensor for a projection's tiles, on
    transparent huge pages (Linux's default `madvise` mode gives them only where asked). A
    decode step streams every weight once: on 4 KiB pages that is a TLB walk every 4 KiB, on
    2 MiB pages one every 512 (measured: benchmarks/linear_kernels.py --pages). Within
    `packed_weight_buffers` (a model's load) buffers lie back to back in a few large
    mappings; elsewhere each is a mapping of its own. Small tensors, and systems without the
    advice, get ordinary memory."""
    size = rows * row_bytes
    if size < _HUGE_PAGE or getattr(mmap, "MADV_HUGEPAGE", None) is None:
        return torch.empty((rows, row_bytes), dtype=torch.uint8)
    packing = _PACKING.get()
    flat = packing.take(size) if packing is not None else _huge_page_mapping(size)
    _fault_in(flat)
    return flat.view(rows, row_bytes)


def _fault_in(flat: torch.Tensor) -> None:
    """Touches every page of a new buffer before anything writes it, the pages split evenly
    among the threads. A fresh page is zeroed by the thread that first writes it, slowly on a
    VM whose host backs a page only when the guest first touches it (one thread's first touch
    of 16 GB: 1.4 GB/s, of memory touched before 9-10 GB/s; 2026-12-07). A repack writes
    ~1 MB at a time split between the threads, and the one that met a new 2 MiB page zeroed
    it while the other waited at the end: a quarter of a 26B MoE's load on the main thread
    (perf; docs/benchmarks.md, "Loading big files"). Only the buffer's own pages: the rest of
    a load's mapping stays untouched."""
    pages = flat.numel() // _SMALL_PAGE
    if pages:
        torch.as_strided(flat, (pages, 64), (_SMALL_PAGE, 1)).zero_()


@contextlib.contextmanager
def packed_weight_buffers() -> Iterator[None]:
    """Within, `weight_buffer` packs its buffers back to back, 64-byte aligned, into mappings of
    256 MiB or more, so that only each mapping's last part-page is on 4 KiB pages rather than
    a part-page at each end of every buffer (a Llama 3.2 3B Q4_K_M's 1.98 GB of tiles in
    ~220 buffers: 84% on huge pages as mappings of their own size, 87% as aligned ones, 100%
    packed; docs/benchmarks.md). A mapping is freed when the last buffer in it is, which fits
    weights: they live and die with their model. The part of a mapping a load leaves unused
    holds no memory but for the rest of the huge page its last buffer ends in."""
    token = _PACKING.set(_Packing())
    try:
        yield
    finally:
        _PACKING.reset(token)


class _Packing:
    """The free end of the current mapping, and where the next buffer starts."""

    def __init__(self) -> None:
        self.free = torch.empty(0, dtype=torch.uint8)

    def take(self, size: int) -> torch.Tensor:
        if size > self.free.numel():
            self.free = _huge_page_mapping(max(_PACK_BYTES, _round_up(size, _HUGE_PAGE)))
        taken = self.free[:size]
        self.free = self.free[_round_up(size, 64) :]
        return taken


_PACKING: ContextVar[_Packing | None] = ContextVar("iterserve_weight_packing", default=None)


def _round_up(n: int, to: int) -> int:
    return -(-n // to) * to


def _huge_page_mapping(size: int) -> torch.Tensor:
    """`size` uint8s in an anonymous mapping of their own, starting on a 2 MiB boundary and
    advised for huge pages but for the part-page at their end. Linux gives huge pages only to
    whole aligned 2 MiB ranges and starts a mapping on any 4 KiB boundary, so the mapping is a
    huge page longer than asked (the slack before the start is never touched: no memory); a
    huge page over the end would hold up to 2 MiB unused, so that part stays on 4 KiB pages,
    also under the `always` mode."""
    region = mmap.mmap(-1, size + _HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    # The tensor holds the mapping (an exported buffer) and unmaps it when freed.
    whole = torch.frombuffer(region, dtype=torch.uint8)
    start = -whole.data_ptr() % _HUGE_PAGE
    huge = size // _HUGE_PAGE * _HUGE_PAGE
    with contextlib.suppress(OSError):  # a kernel built without transparent huge pages
        region.madvise(mmap.MADV_HUGEPAGE, start, huge)
        no_huge = getattr(mmap, "MADV_NOHUGEPAGE", None)
        if no_huge is not None:
            region.madvise(no_huge, start + huge, len(region) - start - huge)
    return whole[start : start + size]


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
