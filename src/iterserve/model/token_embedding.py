"""Token ids -> the rows of an embedding table, held once whatever the table's format."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from iterserve.model.linear import Backend, Linear, WeightMode, WeightPart


class TokenEmbedding:
    """Token ids -> hidden rows. A table the head shares (tied) or kept in its own tiles is
    looked up there, the rows decoded as the kernels multiply them (csrc/repack.cpp's
    dequantize_rows): a quantized or tied table is never also held dense. Otherwise (the
    torch backend, or an untied dense table) a plain tensor."""

    def __init__(
        self,
        table: WeightPart,
        head: Linear | None,
        backend: Backend,
        mode: WeightMode,
        dtype: torch.dtype,
    ) -> None:
        self.dense: torch.Tensor | None = None
        self.tiles: Linear | None = None
        self.own = False  # holds a table of its own (not the head's)
        if head is not None and head.backend == "tiled" and len(head.segments) == 1:
            self.tiles = head
        elif backend == "tiled" and mode == "blocks" and table.blocks is not None:
            self.tiles, self.own = Linear([table], None, backend, mode, dtype), True
        if self.tiles is None or self.tiles.backend != "tiled":
            self.tiles = None
            shared = head.weight if head is not None else None
            if shared is not None:
                self.dense = shared
            else:
                self.dense, self.own = table.dense().to(dtype), True
        self.hidden = table.shape[1]

    @property
    def nbytes(self) -> int:
        """Bytes held for lookups alone (none where the head's weights serve)."""
        if not self.own:
            return 0
        if self.dense is not None:
            return self.dense.numel() * self.dense.element_size()
        assert self.tiles is not None
        return self.tiles.nbytes

    def __call__(self, ids: torch.Tensor) -> torch.Tensor:
        if self.dense is not None:
            return F.embedding(ids, self.dense)
        assert self.tiles is not None
        segments, codes, _ = self.tiles.kernel_args
        return self.tiles.ops.dequantize_rows(segments[0], codes[0], self.hidden, ids, True)
