"""A miniature engine over our model: block tables, num_computed_tokens, one flat batch a step."""

from __future__ import annotations

import random
from collections.abc import Sequence

import torch

from iterserve import kernels
from iterserve.model.attention import allocate_kv_caches
from iterserve.model.attention_metadata import SeqSpan, build_attention_metadata
from iterserve.model.llama import LlamaForCausalLM


class PagedRunner:
    """A miniature engine: hands out shuffled block ids and tracks num_computed_tokens."""

    def __init__(
        self,
        model: LlamaForCausalLM,
        block_size: int = 4,
        num_blocks: int = 96,
        seed: int = 0,
        paged_kernel: bool = False,
        kv_dtype: torch.dtype | None = None,  # the pool's; None: the model's
    ) -> None:
        self.model = model
        self.block_size = block_size
        self.paged_kernel = paged_kernel
        if paged_kernel:  # the C++ ops of the ISA variant selected now (ITERSERVE_ISA)
            model.use_kernel_ops(kernels.ops())
        self.caches = allocate_kv_caches(
            model.config, num_blocks, block_size, kv_dtype or model.dtype, torch.device("cpu")
        )
        self.free = list(range(num_blocks))
        random.Random(seed).shuffle(self.free)  # non-contiguous block tables
        self.tokens: dict[str, list[int]] = {}
        self.blocks: dict[str, list[int]] = {}
        self.computed: dict[str, int] = {}
        # How far a sequence's next steps' rotary positions are from their positions (the
        # text after Qwen3-VL's images); 0 where unset.
        self.rope_shift: dict[str, int] = {}

    def add(self, name: str, tokens: Sequence[int]) -> None:
        self.tokens[name], self.blocks[name], self.computed[name] = list(tokens), [], 0

    def step(self, plan: Sequence[tuple[str, int]]) -> dict[str, torch.Tensor]:
        """Compute `k` new tokens of each named sequence in one flat batch; logits of every row."""
        plan = sorted(plan, key=lambda item: item[1] != 1)  # the decode group goes first
        ids: list[int] = []
        positions: list[int] = []
        spans: list[SeqSpan] = []
        for name, k in plan:
            n = self.computed[name]
            assert n + k <= len(self.tokens[name])
            while len(self.blocks[name]) * self.block_size < n + k:
                self.blocks[name].append(self.free.pop())
            shift = self.rope_shift.get(name, 0)
            spans.append(SeqSpan(tuple(self.blocks[name]), n, k, rope_shift=shift))
            ids.extend(self.tokens[name][n : n + k])
            positions.extend(range(n + shift, n + k + shift))
        meta = build_attention_metadata(
            spans,
            self.block_size,
            torch.device("cpu"),
            self.paged_kernel,
            self.model.config.sliding_window,
            self.model.config.conv_history,
        )
        logits = self.model(
            torch.tensor(ids),
            torch.tensor(positions),
            meta,
            self.caches,
            torch.arange(len(ids)),
        )
        out: dict[str, torch.Tensor] = {}
        row = 0
        for name, k in plan:
            out[name] = logits[row : row + k]
            row += k
            self.computed[name] += k
        return out
