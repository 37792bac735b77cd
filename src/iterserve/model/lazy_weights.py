"""A checkpoint's tensors listed up front and made only when read.

The model is built one tensor at a time (model/llama.py): each projection's kernel format is
made from its parts and the parts dropped, so a checkpoint is never held whole beside the
network. A GGUF's quantized projections are not even made dense: the model reads their
blocks (model/gguf_blocks.py); only the tensors it needs dense are made here.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping

import torch


class LazyWeights(Mapping[str, torch.Tensor]):
    """HF-named tensors, each made by its function at every read (nothing is cached)."""

    def __init__(self) -> None:
        self._makers: dict[str, Callable[[], torch.Tensor]] = {}
        self._natives: dict[str, Callable[[], torch.Tensor]] = {}
        self._shapes: dict[str, tuple[int, ...]] = {}

    def add(
        self,
        name: str,
        shape: tuple[int, ...],
        make: Callable[[], torch.Tensor],
        native: Callable[[], torch.Tensor] | None = None,
    ) -> None:
        """`make` gives the tensor in the model's dtype; `native` (default: `make`) as the
        checkpoint stores it where that is 16-bit, so fp16 weights can stay fp16."""
        self._makers[name] = make
        self._natives[name] = native or make
        self._shapes[name] = tuple(shape)

    def discard(self, name: str) -> None:
        self._makers.pop(name, None)
        self._natives.pop(name, None)
        self._shapes.pop(name, None)

    def native(self, name: str) -> torch.Tensor:
        return self._natives[name]()

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


def native_of(weights: Mapping[str, torch.Tensor], name: str) -> torch.Tensor:
    """A tensor as the checkpoint stores it, where the mapping can tell (else as it is)."""
    if isinstance(weights, LazyWeights):
        return weights.native(name)
    return weights[name]


def shape_of(weights: Mapping[str, torch.Tensor], name: str) -> tuple[int, ...]:
    """A tensor's shape without making it, where the mapping can tell."""
    if isinstance(weights, LazyWeights):
        return weights.shape(name)
    return tuple(weights[name].shape)
