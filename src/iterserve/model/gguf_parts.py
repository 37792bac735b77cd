"""GGUF models in parts. llama.cpp's `llama-gguf-split` and its converter's `--split-max-size`
cut a model into files named PREFIX-00001-of-0000N.gguf ... PREFIX-0000N-of-0000N.gguf, as
hubs publish the larger ones (Qwen's own 7B and 14B Q4_K_M files come in two and three). The
first part holds the metadata and some tensors; each later one holds `split.no`,
`split.count` and more tensors. A model is opened by its first part, as llama.cpp requires,
and the others are found by their names (llama.cpp's `llama_split_path`).

Names only: reading the parts' headers is gguf_loader.read_gguf_header's work.
"""

from __future__ import annotations

import re
from pathlib import Path

from iterserve.model.errors import ModelLoadError

# "-00001-of-00003.gguf": the part's number (from 1) and the count.
_PART_NAME = re.compile(r"-(\d{5})-of-(\d{5})\.gguf$")


def part_number(path: Path) -> tuple[int, int] | None:
    """(number from 1, count) if the file is named as a part of a split model."""
    match = _PART_NAME.search(path.name)
    return (int(match[1]), int(match[2])) if match else None


def part_paths(first: Path, count: int) -> list[Path]:
    """Every part of the model whose first part is `first` and whose metadata says `count`."""
    suffix = _suffix(1, count)
    if not first.name.endswith(suffix):
        raise ModelLoadError(
            f"{first} is the first of {count} parts of a split GGUF, but its name does not end "
            f"in {suffix!r}, which is how its other parts are found: keep the names "
            "llama-gguf-split gave them"
        )
    prefix = first.name.removesuffix(suffix)
    return [first.with_name(prefix + _suffix(n, count)) for n in range(1, count + 1)]


def first_part_name(path: Path, number: int, count: int) -> str:
    """The first part's file name, from part `number`'s (or its pattern, if named otherwise)."""
    suffix = _suffix(number, count)
    if path.name.endswith(suffix):
        return path.name.removesuffix(suffix) + _suffix(1, count)
    return f"PREFIX{_suffix(1, count)}"


def model_stem(path: Path) -> str:
    """The file's stem without a part's "-00001-of-00003": what names the model."""
    return _PART_NAME.sub("", path.name) if part_number(path) else path.stem


def model_file(directory: Path) -> Path | None:
    """The one GGUF model a directory holds: its only .gguf file, or the first part of the
    only split model in it; None if it holds none or several."""
    ggufs = sorted(directory.glob("*.gguf"))
    if len(ggufs) == 1:
        return ggufs[0]
    parts = [(p, part_number(p)) for p in ggufs]
    firsts = [p for p, number in parts if number is not None and number[0] == 1]
    if len(firsts) == 1 and all(number is not None for _, number in parts):
        return firsts[0]
    return None


def _suffix(number: int, count: int) -> str:
    return f"-{number:05d}-of-{count:05d}.gguf"
