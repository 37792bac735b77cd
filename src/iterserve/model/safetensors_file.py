"""A safetensors file read without mapping it: its header says where each tensor's bytes
are, and a tensor (or some of its rows) is read there into memory of its own
(model/file_bytes.py). With the file memory-mapped, every page a load touched stayed in the
resident set until the load ended: a bf16 checkpoint peaked at 2.3x its size
(benchmarks/load_memory.py, 2026-11-26)."""

from __future__ import annotations

import json
import struct
from dataclasses import dataclass
from pathlib import Path

import torch

from iterserve.model.errors import ModelLoadError
from iterserve.model.file_bytes import read_bytes

# safetensors' dtype names.
_DTYPES = {
    "BF16": torch.bfloat16,
    "F16": torch.float16,
    "F32": torch.float32,
    "F64": torch.float64,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
    "F8_E4M3": torch.float8_e4m3fn,
    "F8_E5M2": torch.float8_e5m2,
}


@dataclass(frozen=True)
class StoredTensor:
    """A tensor's place in a safetensors file."""

    path: Path
    offset: int
    shape: tuple[int, ...]
    dtype: str  # safetensors' name of it
    nbytes: int

    def read(self, first: int = 0, count: int | None = None) -> torch.Tensor:
        """Its rows [first, first + count) (all of them by default; a scalar whole)."""
        if self.dtype not in _DTYPES:
            raise ModelLoadError(f"{self.path}: tensors of dtype {self.dtype} are not read")
        rows = self.shape[0] if self.shape else 1
        count = rows - first if count is None else count
        row_bytes = self.nbytes // rows if rows else 0
        raw = read_bytes(self.path, self.offset + first * row_bytes, count * row_bytes)
        tensor = torch.from_numpy(raw).view(_DTYPES[self.dtype])
        return tensor.reshape(self.shape if not self.shape else (count, *self.shape[1:]))


def stored_tensors(path: Path) -> dict[str, StoredTensor]:
    """A safetensors file's tensors and where their bytes are (its header: an 8-byte
    length, then JSON with each tensor's dtype, shape and data offsets)."""
    with path.open("rb") as file:
        (length,) = struct.unpack("<Q", file.read(8))
        header = json.loads(file.read(length))
    stored = {}
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        begin, end = entry["data_offsets"]
        shape = tuple(entry["shape"])
        stored[name] = StoredTensor(path, 8 + length + begin, shape, entry["dtype"], end - begin)
    return stored
