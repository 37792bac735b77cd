"""A file's bytes read where they are, into memory of their own: how checkpoints are read
(GGUF's blocks, model/gguf_blocks.py; safetensors' tensors, model/safetensors_file.py).
Not through a mapping: a mapped file's touched pages stay in the process's resident set
until it is unmapped, so a load would hold the file beside what it built from it."""

from __future__ import annotations

from pathlib import Path

import numpy as np


def read_bytes(path: Path, offset: int, nbytes: int) -> np.ndarray:
    """`nbytes` of the file from `offset`, as a writable uint8 array of its own."""
    buffer = np.empty(nbytes, dtype=np.uint8)
    with path.open("rb", buffering=0) as file:
        file.seek(offset)
        view = memoryview(buffer)
        done = 0
        while done < nbytes:
            count = file.readinto(view[done:])
            if not count:
                raise OSError(
                    f"{path}: ended {nbytes - done} bytes early at offset {offset + done}"
                )
            done += count
    return buffer
