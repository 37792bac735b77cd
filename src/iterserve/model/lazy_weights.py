"""A checkpoint's tensors listed up front and made only when read.

Building the model copies every tensor into its parameters. A GGUF loader that first
dequantized them all held the whole model in bf16 twice (its dict and the parameters), and
the dict lived on while the kernels' copies were built. Made on demand and dropped after the
copy, each tensor is held once: the bundled Q4_1 GGUF's load peak fell from 4.2x to 3.7x its
bf16 size (`benchmarks/load_memory.py`); what remains is the parameters beside the kernels'
own copies, made from them.
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
