"""A network with its paged KV cache: one forward over a flat ragged batch of sequences.

Each sequence contributes its new tokens (at positions `start`...) to one flat batch,
attention metadata is built once for the batch, and logits are computed only at the
last `num_logits` positions of each sequence (and the final-norm hidden states at its
`hidden_rows`, for embeddings: `last_hidden`). The target model's executor and the
draft model's proposer both run their networks through this.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from iterserve.core.kv_reuse import KVCopy
from iterserve.model.attention_metadata import SeqSpan, build_attention_metadata
from iterserve.model.kv_shift import KVShifter
from iterserve.model.llama import LlamaForCausalLM
from iterserve.model.lora_linear import LoRABatch
from iterserve.model.lora_model import LoRAModel


@dataclass(frozen=True)
class ForwardSeq:
    block_ids: Sequence[int]  # the sequence's block table
    start: int  # tokens already in the cache; the new ones go at positions start...
    token_ids: Sequence[int]
    num_logits: int  # logits at this many of the last positions (0: none)
    # Rows (of token_ids) whose final-norm hidden states an embedding pools.
    hidden_rows: range = range(0)
    lora_slot: int = -1  # the slot of its LoRA adapter (-1: the base model)
    # Input rows for some of its tokens (offsets into token_ids), in place of their
    # embeddings: a prompt given as rows, an image's positions.
    embeds: tuple[Sequence[int], torch.Tensor] | None = None
    # Position ranges [first, end) whose tokens attend to each other both ways (an image's
    # in Gemma 3), not causally.
    attend_within: tuple[tuple[int, int], ...] = ()
    # How far its tokens' rotary positions are from their positions (after Qwen-VL's
    # images); or each token's own (time, height, width) rotary positions, where an
    # image's grid is among them (M-RoPE: core/request.py PromptEmbeds.grid_positions).
    rope_shift: int = 0
    grid_positions: Sequence[tuple[int, int, int]] | None = None


class PagedModel:
    def __init__(
        self,
        model: LlamaForCausalLM,
        kv_caches: Sequence[tuple[torch.Tensor, torch.Tensor]],
        block_size: int,
        device: torch.device,
        paged_attention_kernel: bool = False,
    ) -> None:
        self.model = model
        self.kv_caches = list(kv_caches)
        self.block_size = block_size
        self.device = device
        self.paged_attention_kernel = paged_attention_kernel
        # The network's own share of the last forward() (batch and metadata building aside).
        self.last_forward_seconds = 0.0
        # The last forward()'s final-norm hidden states at its sequences' `hidden_rows`, in
        # order [rows, hidden] (None: it asked for none).
        self.last_hidden: torch.Tensor | None = None
        # Its LoRA slots, when it serves adapters (model/lora_model.py).
        self.lora: LoRAModel | None = model.lora
        self._kv_shifter: KVShifter | None = None

    @property
    def kv_cache_bytes(self) -> int:
        """The pool's bytes (a pair that layers share counted once)."""
        pairs = {id(pair[0]): pair for pair in self.kv_caches}.values()
        return sum(k.nbytes + v.nbytes for k, v in pairs)

    def enable_kv_shift(self) -> None:
        """Get ready to move cached K/V to other positions (--cache-reuse); raises
        UnsupportedKVShift, saying why, for a model whose K/V cannot move."""
        self._kv_shifter = KVShifter(self.model.config, self.kv_caches, self.model.rope_positions)

    def copy_kv(self, copies: Sequence[KVCopy]) -> None:
        """Copy cached K/V rows between slots, the keys turned to their new positions."""
        if self._kv_shifter is None:
            self.enable_kv_shift()
        assert self._kv_shifter is not None
        self._kv_shifter.apply(copies)

    @torch.inference_mode()
    def forward(self, seqs: Sequence[ForwardSeq]) -> torch.Tensor:
        """Write every sequence's new tokens' K/V into the cache; logits [rows, vocab] for
        the asked positions, sequence by sequence."""
        input_ids: list[int] = []
        positions: list[int] = []
        spans: list[SeqSpan] = []
        logits_indices: list[int] = []
        hidden_indices: list[int] = []
        given_rows: list[int] = []  # rows given as input rows, and the rows themselves
        given: list[torch.Tensor] = []
        grid_positions: list[tuple[int, int, int]] = []  # every row's, where any is a grid's
        any_grid = any(seq.grid_positions is not None for seq in seqs)
        for seq in seqs:
            hidden_indices.extend(len(input_ids) + row for row in seq.hidden_rows)
            if seq.embeds is not None:
                offsets, rows = seq.embeds
                given_rows.extend(len(input_ids) + offset for offset in offsets)
                given.append(rows)
            input_ids.extend(seq.token_ids)
            first = seq.start + seq.rope_shift
            rotary = range(first, first + len(seq.token_ids))
            positions.extend(rotary)
            if any_grid:
                grid_positions.extend(seq.grid_positions or [(p, p, p) for p in rotary])
            spans.append(
                SeqSpan(
                    seq.block_ids,
                    seq.start,
                    len(seq.token_ids),
                    seq.attend_within,
                    seq.rope_shift,
                    grid_rotary=seq.grid_positions is not None,
                )
            )
            logits_indices.extend(range(len(input_ids) - seq.num_logits, len(input_ids)))
        meta = build_attention_metadata(
            spans,
            self.block_size,
            self.device,
            self.paged_attention_kernel,
            self.model.config.sliding_window,
            self.model.config.conv_history,
        )
        inputs = (
            torch.tensor(input_ids, dtype=torch.long, device=self.device),
            torch.tensor(positions, dtype=torch.long, device=self.device),
        )
        indices = torch.tensor(logits_indices, dtype=torch.long, device=self.device)
        start = time.perf_counter()
        if self.lora is not None:
            self.lora.state.batch = _lora_batch(seqs, self.device)
        try:
            given_inputs = None
            if given:
                rows = torch.tensor(given_rows, dtype=torch.long, device=self.device)
                given_inputs = (rows, torch.cat(given).to(self.device))
            grid = None
            if any_grid:  # [3, rows]
                grid = torch.tensor(grid_positions, dtype=torch.long, device=self.device).T
            hidden = self.model.hidden_states(*inputs, meta, self.kv_caches, given_inputs, grid)
        finally:
            if self.lora is not None:
                self.lora.state.batch = None
        logits = self.model.logits(hidden, indices)
        self.last_hidden = None
        if hidden_indices:
            rows = torch.tensor(hidden_indices, dtype=torch.long, device=self.device)
            self.last_hidden = self.model.normed(hidden, rows)
        self.last_forward_seconds = time.perf_counter() - start
        return logits

    @property
    def argmax_rows(self) -> Callable[[torch.Tensor], torch.Tensor] | None:
        """The kernels' argmax for greedy sampling, where the model runs on them."""
        ops = self.model.kernel_ops
        return None if ops is None else ops.argmax_rows

    def close(self) -> None:
        """Nothing to release in one process (a tensor-parallel network stops its workers)."""

    @torch.inference_mode()
    def warm_up(self) -> float:
        """Run dummy steps of the shapes serving meets (a lone decode, a prompt, decodes beside
        a chunk over a cached prefix), so compiling, loading compiled graphs and the kernels'
        first-call set-up happen before the first request. Returns the seconds it took.

        The steps write K/V into blocks 0 and 1, which are free at start-up: any request that
        gets them later overwrites every slot before reading it.
        """
        start = time.perf_counter()
        last = min(2, self.kv_caches[0][0].shape[1]) - 1
        steps = [
            [ForwardSeq((0,), 0, [0], 1)],
            [ForwardSeq((0,), 0, [0] * 3, 3)],
            [ForwardSeq((0,), 2, [0], 1), ForwardSeq((last,), 1, [0] * 2, 2)],
        ]
        for seqs in steps:
            self.forward(seqs)
        self.model.freeze_compiled()
        return time.perf_counter() - start


def _lora_batch(seqs: Sequence[ForwardSeq], device: torch.device) -> LoRABatch | None:
    """Each token's LoRA slot; None when every row runs the base model."""
    if all(seq.lora_slot < 0 for seq in seqs):
        return None
    return LoRABatch([seq.lora_slot for seq in seqs for _ in seq.token_ids], device)
