"""One step's attention metadata: which rows attend how, over which blocks, built once per step.

With the C++ paged attention op (kernels/csrc/paged_attention.cpp) every row of the step is a
*kernel row*: one call per layer stores the step's K/V and attends every sequence, decode or
prefill chunk, reading K/V in place through its block table. It beats the torch paths at
every shape measured, prefill included (2.8x on a 512-token prompt, 30 layers,
measured once; benchmarks/attention_kernel.py has the decode shapes).

Without it the rows come in two runs, in order:

1. *decode rows*: leading one-token sequences, served together by the torch decode path in
   attention.py;
2. *prefill chunks*: every other sequence, each attending causally over its cached prefix and
   itself through flash SDPA.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch


@dataclass(frozen=True)
class SeqSpan:
    """One sequence's part of the step, in the engine's terms."""

    block_ids: Sequence[int]
    num_computed_tokens: int  # tokens already in the KV cache (positions 0..n-1)
    num_new_tokens: int  # tokens computed this step (positions n..n+k-1)
    # Position ranges [first, end) whose tokens attend to each other both ways (Gemma 3's
    # images); the step then takes the torch paths, whose masks say so.
    attend_within: tuple[tuple[int, int], ...] = ()
    # How far its rows' rotary positions are from their positions (after Qwen-VL's
    # images); `grid_rotary`: its rows turn by positions of their own (an image's grid,
    # M-RoPE): the step's rotary tables are then its own rows (model/llama.py), and each
    # row of every sequence in it is at its row's position.
    rope_shift: int = 0
    grid_rotary: bool = False


@dataclass(frozen=True)
class KernelRows:
    """The step's sequences for the C++ ops, packed in one int32 tensor (StepTable in
    kernels/csrc/ops.h): [S, max_blocks, block tables (S x max_blocks, padding never read),
    seq_lens (context lengths, this step's tokens included), query_start_loc (S + 1:
    sequence s owns rows loc[s]..loc[s+1]-1)], then, where any sequence's rotary positions
    are shifted (SeqSpan.rope_shift), each sequence's shift; where any turns as a grid
    (SeqSpan.grid_rotary), the shift that puts each row at its row in the step."""

    num_tokens: int
    packed: torch.Tensor


@dataclass(frozen=True)
class PrefillChunk:
    """A multi-token span: its queries attend causally over the cached prefix and themselves."""

    query_start: int  # first row of the chunk in the flat batch
    query_end: int  # one past its last row
    num_cached_tokens: int  # n: keys at positions < n come from earlier steps
    # Block ids covering positions 0..n+k-1, or None when n == 0: a fresh prompt attends to
    # this step's k/v directly, so nothing needs gathering.
    context_blocks: torch.Tensor | None
    # [1, 1, k, len(context_blocks) * block_size] additive (0 / -inf): query i sees keys
    # j <= n + i (and, with a sliding window, j > n + i - window), which also hides the tail
    # padding of the last block. When n == 0, [1, 1, k, k] over the chunk itself if a window
    # cuts into it, else None (plain causal attention).
    attn_mask: torch.Tensor | None
    attend_within: tuple[tuple[int, int], ...] = ()  # SeqSpan's: keys ahead seen there too


@dataclass
class AttentionMetadata:
    """Everything the layers need for one step, built once by `build_attention_metadata`."""

    block_size: int
    num_tokens: int  # T, rows of the flat batch
    sliding_window: int  # keys further back than this are hidden from a query; 0: none
    slot_mapping: torch.Tensor  # [T] int64: cache slot each new token's K/V is written to
    kernel: KernelRows | None  # every row, for the C++ op; None: the torch paths run
    num_decodes: int  # B, the torch decode group's size (0 when the C++ op runs)
    # [B * decode_max_blocks] int64: the group's block tables, row-major, each padded with its
    # own first block so masked lanes still read finite K/V (0 * NaN would poison the output).
    decode_block_table: torch.Tensor
    decode_max_blocks: int
    # [B, decode_max_blocks * block_size] float32 additive: -inf past each context end.
    decode_mask: torch.Tensor
    decode_context_lens: list[int]  # context length of each decode, new token included
    prefills: list[PrefillChunk]
    max_context_len: int  # longest context in the step, new tokens included
    # [T, history] int64: the cache slots of each new token's `history` predecessors, oldest
    # first, -1 before a sequence's start: what an LFM2 conv layer reads (model/short_conv.py).
    # None: the model has no conv layers.
    conv_slots: torch.Tensor | None = None
    # Per-cache derived tensors, built by the first layer that needs them (attention.py).
    plans: dict[tuple[object, ...], object] = field(default_factory=dict, repr=False)


def _blocks_for(span: SeqSpan, num_tokens: int, block_size: int) -> list[int]:
    needed = -(-num_tokens // block_size)
    if len(span.block_ids) < needed:
        raise ValueError(
            f"span needs {needed} blocks for {num_tokens} tokens but has {len(span.block_ids)}"
        )
    return list(span.block_ids[:needed])


def _leading(spans: Sequence[SeqSpan], max_query_len: int) -> int:
    count = 0
    while count < len(spans) and spans[count].num_new_tokens <= max_query_len:
        count += 1
    return count


def decode_mask(lens: Sequence[int], max_blocks: int, block_size: int, window: int) -> torch.Tensor:
    """[B, max_blocks * block_size] float32 additive: -inf past each context's end and, with a
    window, at keys more than `window` positions back."""
    mask = torch.zeros(len(lens), max_blocks * block_size)
    if lens:
        key_pos = torch.arange(max_blocks * block_size)
        ends = torch.tensor(list(lens))[:, None]
        hidden = key_pos[None, :] >= ends
        if window:
            hidden |= key_pos[None, :] <= ends - 1 - window
        mask.masked_fill_(hidden, float("-inf"))
    return mask


def chunk_mask(
    n: int,
    k: int,
    num_blocks: int,
    block_size: int,
    window: int,
    attend_within: Sequence[tuple[int, int]] = (),
) -> torch.Tensor | None:
    """A prefill chunk's [1, 1, k, keys] additive mask (PrefillChunk.attn_mask); None when
    plain causal attention over the chunk itself is right. Within each of `attend_within`'s
    ranges the queries also see the keys ahead of them, as transformers ORs an image's
    block into Gemma 3's causal mask (a window still applies)."""
    if not (n > 0 or (window and k > window) or attend_within):
        return None
    positions = torch.arange(n, n + k)
    # Keys are the cached context (n > 0) or this chunk itself.
    key_pos = torch.arange(num_blocks * block_size if n > 0 else k)
    hidden = key_pos[None, :] > positions[:, None]
    for first, end in attend_within:
        queries = (positions >= first) & (positions < end)
        keys = (key_pos >= first) & (key_pos < end)
        hidden &= ~(queries[:, None] & keys[None, :])
    if window:
        hidden |= key_pos[None, :] <= positions[:, None] - window
    return torch.zeros(k, len(key_pos)).masked_fill_(hidden, float("-inf"))[None, None]


def _kernel_rows(spans: Sequence[SeqSpan], block_size: int, device: torch.device) -> KernelRows:
    tables = [_blocks_for(s, s.num_computed_tokens + s.num_new_tokens, block_size) for s in spans]
    width = max(len(t) for t in tables)
    padded = [t + [0] * (width - len(t)) for t in tables]
    lens = [s.num_computed_tokens + s.num_new_tokens for s in spans]
    starts = [0]
    for s in spans:
        starts.append(starts[-1] + s.num_new_tokens)
    packed = [len(spans), width, *(b for row in padded for b in row), *lens, *starts]
    if any(s.grid_rotary for s in spans):  # a row's rotary position: its row in the step
        packed.extend(
            start - s.num_computed_tokens for start, s in zip(starts[:-1], spans, strict=True)
        )
    elif any(s.rope_shift for s in spans):
        packed.extend(s.rope_shift for s in spans)
    return KernelRows(
        num_tokens=starts[-1], packed=torch.tensor(packed, dtype=torch.int32).to(device)
    )


def _decode_table(
    decodes: Sequence[SeqSpan], lengths: list[int], block_size: int
) -> tuple[list[int], int]:
    """The torch decode group's block table, flat, each row padded to the longest (one table
    and one length mask serve every layer), and that row length in blocks."""
    max_blocks = -(-max(lengths, default=0) // block_size)
    table: list[int] = []
    for span, length in zip(decodes, lengths, strict=True):
        blocks = _blocks_for(span, length, block_size)
        table.extend(blocks)
        table.extend([blocks[0]] * (max_blocks - len(blocks)))
    return table, max_blocks


def _slots_and_chunks(
    spans: Sequence[SeqSpan], first_chunk: int, block_size: int, window: int, device: torch.device
) -> tuple[list[int], list[PrefillChunk], int]:
    """Every new token's cache slot, the torch prefill chunks (spans from `first_chunk` on)
    and the step's token count."""
    slots: list[int] = []
    prefills: list[PrefillChunk] = []
    start = 0
    for index, span in enumerate(spans):
        n, k = span.num_computed_tokens, span.num_new_tokens
        block_list = _blocks_for(span, n + k, block_size)
        # Plain Python: a step is mostly decodes, one slot each, and tensors cost more here.
        slots.extend(
            block_list[p // block_size] * block_size + p % block_size for p in range(n, n + k)
        )
        if index >= first_chunk:
            blocks = torch.tensor(block_list, dtype=torch.int64)
            mask = chunk_mask(n, k, len(blocks), block_size, window, span.attend_within)
            mask = None if mask is None else mask.to(device)
            prefills.append(
                PrefillChunk(
                    query_start=start,
                    query_end=start + k,
                    num_cached_tokens=n,
                    context_blocks=blocks.to(device) if n > 0 else None,
                    attn_mask=mask,
                    attend_within=span.attend_within,
                )
            )
        start += k
    return slots, prefills, start


def _conv_slots(spans: Sequence[SeqSpan], block_size: int, history: int) -> list[int]:
    """Every new token's `history` predecessors' cache slots, oldest first (-1: none), flat."""
    slots: list[int] = []
    for span in spans:
        n, k = span.num_computed_tokens, span.num_new_tokens
        blocks = span.block_ids
        for p in range(n, n + k):
            slots.extend(
                blocks[q // block_size] * block_size + q % block_size if q >= 0 else -1
                for q in range(p - history, p)
            )
    return slots


def build_attention_metadata(
    spans: Sequence[SeqSpan],
    block_size: int,
    device: torch.device,
    paged_kernel: bool = False,
    sliding_window: int | None = None,
    conv_history: int = 0,
) -> AttentionMetadata:
    """Turn the step's spans (flat-batch order, one-token spans first) into layer-ready tensors.

    `paged_kernel` hands every row to the C++ paged attention op, whose arithmetic for a row
    is the same whatever shares its step; otherwise rows take the torch paths. `sliding_window` (Mistral)
    hides keys more than that many positions back, in every path's masks. `conv_history`
    (ModelConfig.conv_history): how many predecessors' slots each token's conv layers read.
    Everything is built on the host with a handful of vectorised ops and moved once.
    """
    window = sliding_window or 0
    if any(s.num_new_tokens < 1 or s.num_computed_tokens < 0 for s in spans):
        raise ValueError("every span needs num_new_tokens >= 1 and num_computed_tokens >= 0")
    # The C++ op attends causally: a step with both-ways ranges takes the torch paths.
    paged_kernel = paged_kernel and not any(s.attend_within for s in spans)
    num_kernel = len(spans) if paged_kernel else 0
    kernel = _kernel_rows(spans, block_size, device) if num_kernel else None
    num_decodes = 0 if paged_kernel else _leading(spans, 1)

    decode_lens = [s.num_computed_tokens + 1 for s in spans[:num_decodes]]
    table, max_blocks = _decode_table(spans[:num_decodes], decode_lens, block_size)
    decode_masks = decode_mask(decode_lens, max_blocks, block_size, window)
    slots, prefills, start = _slots_and_chunks(
        spans, num_kernel + num_decodes, block_size, window, device
    )

    return AttentionMetadata(
        block_size=block_size,
        num_tokens=start,
        sliding_window=window,
        slot_mapping=torch.tensor(slots, dtype=torch.int64).to(device),
        kernel=kernel,
        num_decodes=num_decodes,
        decode_block_table=torch.tensor(table, dtype=torch.int64).to(device),
        decode_max_blocks=max_blocks,
        decode_mask=decode_masks.to(device),
        decode_context_lens=decode_lens,
        prefills=prefills,
        max_context_len=max(
            (s.num_computed_tokens + s.num_new_tokens for s in spans),
            default=0,
        ),
        conv_slots=torch.tensor(_conv_slots(spans, block_size, conv_history), dtype=torch.int64)
        .view(start, conv_history)
        .to(device)
        if conv_history
        else None,
    )
