"""A checkpoint's tensors listed up front and made only when read.

Building the model copies every tensor into its parameters; a loader that first made
them all (a GGUF dequantized to bf16, a safetensors file read whole) held the checkpoint
twice in the model's dtype at the peak of a load: 2x the model's bf16 size, plus any 4-bit
blocks kept. Made on demand and dropped after the copy, it is held once
(`benchmarks/load_memory.py` measures the peak).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping

import torch


class LazyWeights(Mapping[str, torch.Tensor]):
    """HF-named tensors, each made by its function at every read (nothing is cached)."""

    def __init__(self) -> None:
        self._makers: dict[str, Callable[[], torch.Tensor]] = {}
        self._shapes: dict[str, tuple[int, ...]] = {}

    def add(self, name: str, shape: tuple[int, ...], make: Callable[[], torch.Tensor]) -> None:
        self._makers[name] = make
        self._shapes[name] = tuple(shape)

    def discard(self, name: str) -> None:
        self._makers.pop(name, None)
        self._shapes.pop(name, None)

    def shape(self, name: str) -> tuple[int, ...]:
        return self._shapes[name]

    def __getitem__(self, name: str) -> torch.Tensor:
        return self._makers[name]()

    def __iter__(self) -> Iterator[str]:
        return iter(self._makers)

    def __len__(self) -> int:
        return len(self._makers)

    def __contains__(self, name: object) -> bool:
        return name in self._makers


def shape_of(weights: Mapping[str, torch.Tensor], name: str) -> tuple[int, ...]:
    """A tensor's shape without making it, where the mapping can tell."""
    if isinstance(weights, LazyWeights):
        return weights.shape(name)
    return tuple(weights[name].shape)
