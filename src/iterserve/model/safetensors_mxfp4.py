"""OpenAI's gpt-oss checkpoints keep the experts in MXFP4, as safetensors pairs per layer:

    mlp.experts.gate_up_proj_blocks  uint8 [experts, 2 x width, hidden / 32, 16]
    mlp.experts.gate_up_proj_scales  uint8 [experts, 2 x width, hidden / 32]
    mlp.experts.down_proj_blocks     uint8 [experts, hidden, width / 32, 16]
    mlp.experts.down_proj_scales     uint8 [experts, hidden, width / 32]

A row is an output (gate_up's rows interleave gate's and up's: even rows are gate's), a
block 32 inputs: 16 bytes of 4-bit e2m1 codes, input 2i in byte i's low nibble and 2i + 1
in its high one, and an E8M0 scale byte e: w = fp4[code] 2^(e - 127) (transformers'
integrations/mxfp4.py). GGUF's MXFP4 is the same numbers in another order: a block is e,
then 16 bytes with input i in byte i's low nibble and i + 16 in its high one, and values
doubled against a scale halved (2^(e - 128)). So each expert's projection is read as GGUF
MXFP4 rows (`MXFP4Rows`), nibbles reordered a slice of rows at a time, and runs from its
blocks like a GGUF's (model/gguf_blocks.py): nothing is made in bf16.

The bytes are read at their offsets in the file (model/safetensors_file.py), not through a
mapping, as GGUF tensors are: a load's resident memory is then the tiles it built.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from iterserve.model.block_formats import BLOCK_FORMATS, BlockFormat
from iterserve.model.errors import ModelLoadError
from iterserve.model.file_bytes import read_bytes
from iterserve.model.gguf_blocks import QuantizedBlocks
from iterserve.model.safetensors_file import StoredTensor, stored_tensors

MXFP4 = BLOCK_FORMATS["MXFP4"]
_BLOCK = 32
_STACK = re.compile(r"(.*\.mlp\.experts)\.(gate_up_proj|down_proj)_(blocks|scales)")


def is_mxfp4_tensor(name: str) -> bool:
    return _STACK.fullmatch(name) is not None


@dataclass(frozen=True)
class MXFP4Rows(QuantizedBlocks):
    """One expert's projection [N, K]: its rows `first`, `first + step`, ... of the
    expert's slab of the blocks and scales stacks."""

    blocks: StoredTensor  # the expert's slab of the blocks stack: [rows, K / 32, 16]
    scales: StoredTensor  # and of the scales: [rows, K / 32]
    first: int
    step: int
    shape: tuple[int, int]
    format: BlockFormat = MXFP4
    rows: torch.Tensor | None = None

    def read(self, start: int = 0, stop: int | None = None) -> np.ndarray:
        stop = self.shape[0] if stop is None else stop
        groups = self.shape[1] // _BLOCK
        lo, span = self.first + self.step * start, self.step * (stop - start - 1) + 1
        codes = read_bytes(
            self.blocks.path, self.blocks.offset + lo * groups * 16, span * groups * 16
        )
        exps = read_bytes(self.scales.path, self.scales.offset + lo * groups, span * groups)
        codes = codes.reshape(span, groups, 16)[:: self.step]
        exps = exps.reshape(span, groups, 1)[:: self.step]
        # Inputs in order (2i, 2i + 1 from byte i), then GGUF's pairing (i, i + 16).
        values = np.stack((codes & 15, codes >> 4), axis=-1).reshape(-1, groups, _BLOCK)
        paired = values[..., :16] | (values[..., 16:] << 4)
        return np.concatenate((exps, paired), axis=-1).reshape(stop - start, -1)


def gpt_oss_mxfp4_experts(shards: list[Path]) -> dict[str, MXFP4Rows]:
    """Every expert projection held as MXFP4 blocks in these safetensors files, by the
    HF name the model reads it under (model/moe.py: `...mlp.experts.E.gate_proj.weight`)."""
    stored = {
        name: place
        for shard in shards
        for name, place in stored_tensors(shard).items()
        if is_mxfp4_tensor(name) and place.dtype == "U8"
    }
    experts: dict[str, MXFP4Rows] = {}
    for name, codes in stored.items():
        match = _STACK.fullmatch(name)
        assert match is not None
        prefix, stack, kind = match.groups()
        if kind != "blocks":
            continue
        scales = stored.get(f"{prefix}.{stack}_scales")
        count, rows, groups, width = codes.shape
        if width != 16 or scales is None or scales.shape != (count, rows, groups):
            raise ModelLoadError(
                f"{name}: MXFP4 blocks [experts, rows, inputs / 32, 16] need their scales "
                f"[experts, rows, inputs / 32] beside them; found {codes.shape} and "
                f"{None if scales is None else scales.shape}"
            )
        projections = {"gate_proj": (0, 2), "up_proj": (1, 2)}
        if stack == "down_proj":
            projections = {"down_proj": (0, 1)}
        for expert in range(count):
            size = rows * groups  # the expert's scale bytes; 16 code bytes to each
            slab = StoredTensor(
                codes.path, codes.offset + expert * size * 16, codes.shape[1:], "U8", size * 16
            )
            slab_scales = StoredTensor(
                scales.path, scales.offset + expert * size, scales.shape[1:], "U8", size
            )
            for projection, (first, step) in projections.items():
                shape = (rows // step, groups * _BLOCK)
                experts[f"{prefix}.{expert}.{projection}.weight"] = MXFP4Rows(
                    slab, slab_scales, first, step, shape
                )
    return experts
