"""A weight's quantized blocks, found in the file but not read: what the model's
projections are built from (model/linear.py), one tensor at a time, straight into the
kernels' tiles. A GGUF tensor's (`GGUFBlocks`), or another file's blocks of a GGUF format
(model/safetensors_mxfp4.py: OpenAI's MXFP4 experts).

The bytes are read with positioned reads, a slice of rows at a time, into the load's one
buffer (model/file_bytes.py `SliceReader`), which the next slice overwrites once its rows
are repacked: nothing keeps the file mapped, so a load's resident memory is the tiles it
built plus one slice (a mapped file's touched pages would stay resident until unmapped).
"""

from __future__ import annotations

import os
from abc import ABC, abstractmethod
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from gguf import GGMLQuantizationType
from gguf.quants import dequantize

from iterserve.model.block_formats import TILE, BlockFormat, padded_rows, repack
from iterserve.model.file_bytes import SliceReader, read_bytes, slice_reader
from iterserve.model.host_memory import weight_buffer

# Bytes of file read at once when repacking a large tensor.
_SLICE_BYTES = 64 << 20


class QuantizedBlocks(ABC):
    """An [N, K] weight in a block format (model/block_formats.py), not read yet: its rows
    as GGUF lays out that format, read a slice at a time. `rows`: output row i is stored row
    rows[i] (llama.cpp's rope permutation of q/k undone), or None for the stored order."""

    shape: tuple[int, int]
    format: BlockFormat
    rows: torch.Tensor | None

    @abstractmethod
    def read(self, start: int = 0, stop: int | None = None) -> np.ndarray:
        """Stored rows [start, stop) as [rows, row_bytes] uint8, in GGUF's block layout."""

    @property
    def nbytes(self) -> int:
        return self.shape[0] * self.format.row_bytes(self.shape[1])

    @property
    def file_order(self) -> tuple[str, int]:
        """Where the blocks lie (file, offset), to read several in their files' order."""
        return ("", 0)

    def dequantize(self) -> torch.Tensor:
        """The weights in fp32, by the `gguf` package's dequantizer (the reference)."""
        qtype = GGMLQuantizationType[self.format.name]
        values = torch.from_numpy(dequantize(self.read(), qtype).reshape(self.shape))
        return values if self.rows is None else values[self.rows]

    def read_slice(self, reader: SliceReader, start: int, stop: int) -> np.ndarray:
        """Stored rows [start, stop) as `read` gives them, possibly in `reader`'s buffer
        (valid until its next read)."""
        return self.read(start, stop)

    def tiles(self, ops: object, out: torch.Tensor | None = None) -> torch.Tensor:
        """The kernels' tiles ([N/16 padded, bytes] uint8), built a slice of rows at a time;
        into `out` if given (rows in their file order only)."""
        n, k = self.shape
        with slice_reader() as reader:
            if self.rows is not None:  # a permutation reads rows anywhere: the whole tensor
                assert out is None
                padding = torch.full((padded_rows(n) - n,), -1, dtype=torch.long)
                raw = self.read_slice(reader, 0, n)
                return repack(ops, raw, self.format, k, torch.cat((self.rows.long(), padding)))
            if out is None:
                out = weight_buffer(padded_rows(n) // TILE, self.format.bytes_per_tile(k))
            step = max(TILE, _SLICE_BYTES // self.format.row_bytes(k) // TILE * TILE)
            for start in range(0, n, step):
                stop = min(n, start + step)
                raw = self.read_slice(reader, start, stop)
                repack(ops, raw, self.format, k, out=out, first_tile=start // TILE)
        return out


@dataclass(frozen=True)
class GGUFBlocks(QuantizedBlocks):
    """A GGUF tensor's blocks at `offset` in the file (an expert's slice of a stacked tensor
    is one too)."""

    path: Path
    offset: int
    shape: tuple[int, int]
    format: BlockFormat
    rows: torch.Tensor | None = None

    def read(self, start: int = 0, stop: int | None = None) -> np.ndarray:
        stop = self.shape[0] if stop is None else stop
        row_bytes = self.format.row_bytes(self.shape[1])
        raw = read_bytes(self.path, self.offset + start * row_bytes, (stop - start) * row_bytes)
        return raw.reshape(stop - start, row_bytes)

    def read_slice(self, reader: SliceReader, start: int, stop: int) -> np.ndarray:
        row_bytes = self.format.row_bytes(self.shape[1])
        raw = reader.read(self.path, self.offset + start * row_bytes, (stop - start) * row_bytes)
        return raw.reshape(stop - start, row_bytes)

    @property
    def file_order(self) -> tuple[str, int]:
        return (str(self.path), self.offset)


def expert_slices(blocks: GGUFBlocks, count: int) -> list[GGUFBlocks]:
    """A stacked [E * N, K] tensor's experts, each [N, K] (their bytes are consecutive)."""
    n = blocks.shape[0] // count
    step = n * blocks.format.row_bytes(blocks.shape[1])
    return [
        GGUFBlocks(blocks.path, blocks.offset + e * step, (n, blocks.shape[1]), blocks.format)
        for e in range(count)
    ]


def file_size(path: Path) -> int:
    return os.stat(path).st_size
