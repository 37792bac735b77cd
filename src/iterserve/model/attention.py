"""Paged attention for one ragged step: a decode group plus prefill chunks over a block pool.

Cache layout, per layer: K and V are each ``[num_kv_heads, num_blocks, block_size, head_dim]``.
Head-major is what makes reading cheap: gathering whole blocks (``block_size * head_dim``
contiguous elements each) from a ``[num_kv_heads * num_blocks, block_size * head_dim]`` view
yields ``[kv_heads, batch, context, head_dim]`` directly, in one ``index_select`` and with no
transpose copy. Writing a token touches one ``head_dim`` row per head: a step writes few.

Decode (one query per sequence) is bound by reading the context. While the group's gathered
K/V is small enough to stay in cache, gathering both and running flash SDPA is fastest. Past
that, copying the context out of the pool first doubles the memory traffic, so K is gathered
once for a grouped matmul (q viewed [kv_heads, B, group, head_dim]; K never repeated per query
head) and V is not gathered at all: ``embedding_bag`` sums probability-weighted V rows
straight from the pool. At SmolLM2 shapes on the 2-core CPU that halved decode attention at
batch 32 x 256 tokens and at batch 8 x 1024 (benchmarks/model_step.py --kernels). Prefill
chunks (many queries) use flash SDPA, which beat fp32 SDPA and grouped matmul there. Every
path is exact in fp32.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from iterserve.model.config import ModelConfig


@dataclass(frozen=True)
class SeqSpan:
    """One sequence's part of the step, in the engine's terms."""

    block_ids: Sequence[int]
    num_computed_tokens: int  # tokens already in the KV cache (positions 0..n-1)
    num_new_tokens: int  # tokens computed this step (positions n..n+k-1)


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
    # j <= n + i, which also hides the tail padding of the last block. None when n == 0
    # (plain causal attention over the chunk itself).
    attn_mask: torch.Tensor | None


# Up to this many bytes of gathered K+V (about an L2 cache), gather + flash SDPA wins decode.
_SDPA_DECODE_MAX_BYTES = 2 << 20


@dataclass(frozen=True)
class _LayerPlan:
    """Per-step tensors that depend on the cache's shape and dtype, shared by all layers."""

    decode_key_rows: torch.Tensor | None  # [kv_heads * B * max_blocks] rows of the flat K view
    # Rows of the flat V view ([kv_heads * slots, head_dim]) and where each bag starts, one bag
    # per (kv head, sequence, query head of the group). None: decode gathers V for flash SDPA.
    decode_value_rows: torch.Tensor | None
    decode_value_offsets: torch.Tensor | None
    # decode_mask shaped for the chosen path: [1, B, 1, context] float32 for the grouped
    # matmul, [B, 1, 1, context] in the cache dtype for SDPA.
    decode_bias: torch.Tensor | None
    prefill_rows: list[torch.Tensor | None]
    prefill_masks: list[torch.Tensor | None]  # cast to the cache dtype


def _build_plan(meta: AttentionMetadata, num_heads: int, key_cache: torch.Tensor) -> _LayerPlan:
    num_kv_heads, num_blocks, block_size, head_dim = key_cache.shape
    if block_size != meta.block_size:
        raise ValueError(f"cache blocks hold {block_size} tokens, metadata says {meta.block_size}")
    device, dtype = key_cache.device, key_cache.dtype
    heads = torch.arange(num_kv_heads, device=device) * num_blocks

    def rows(blocks: torch.Tensor | None) -> torch.Tensor | None:
        return None if blocks is None else (heads[:, None] + blocks[None, :]).reshape(-1)

    key_rows = value_rows = value_offsets = bias = None
    batch = meta.num_decodes
    if batch:
        key_rows = rows(meta.decode_block_table)
        context = meta.decode_max_blocks * block_size
        gathered_bytes = 2 * batch * context * num_kv_heads * head_dim * key_cache.element_size()
        if gathered_bytes <= _SDPA_DECODE_MAX_BYTES:
            bias = meta.decode_mask.view(batch, 1, 1, context).to(dtype)
        else:
            table = meta.decode_block_table.view(batch, meta.decode_max_blocks)
            in_block = torch.arange(block_size, device=device)
            slots = (table[:, :, None] * block_size + in_block).view(batch, 1, context)
            group = num_heads // num_kv_heads
            value_rows = heads[:, None, None, None] * block_size + slots[None]
            value_rows = value_rows.expand(num_kv_heads, batch, group, context).reshape(-1)
            value_offsets = torch.arange(0, value_rows.numel(), context, device=device)
            bias = meta.decode_mask.view(1, batch, 1, context)
    return _LayerPlan(
        decode_key_rows=key_rows,
        decode_value_rows=value_rows,
        decode_value_offsets=value_offsets,
        decode_bias=bias,
        prefill_rows=[rows(c.context_blocks) for c in meta.prefills],
        prefill_masks=[
            None if c.attn_mask is None else c.attn_mask.to(dtype) for c in meta.prefills
        ],
    )


@dataclass
class AttentionMetadata:
    """Everything the layers need for one step, built once by `build_attention_metadata`.

    Rows ``0..num_decodes-1`` of the flat batch are the decode group (one query each); the
    rest are the `prefills`, in order.
    """

    block_size: int
    num_tokens: int  # T, rows of the flat batch
    slot_mapping: torch.Tensor  # [T] int64: cache slot each new token's K/V is written to
    num_decodes: int  # B, the decode group size
    # [B * decode_max_blocks] int64: the group's block tables, row-major, each padded with its
    # own first block so masked lanes still read finite K/V (0 * NaN would poison the output).
    decode_block_table: torch.Tensor
    decode_max_blocks: int
    # [B, decode_max_blocks * block_size] float32 additive: -inf past each context end.
    decode_mask: torch.Tensor
    decode_context_lens: list[int]  # context length of each decode, new token included
    prefills: list[PrefillChunk]
    max_context_len: int  # longest context in the step, new tokens included
    _plans: dict[tuple[object, ...], _LayerPlan] = field(default_factory=dict, repr=False)

    def plan(self, num_heads: int, key_cache: torch.Tensor) -> _LayerPlan:
        """Gather rows and typed masks for this cache; the first layer builds, the rest reuse.

        They depend on the cache's shape and dtype, which `build_attention_metadata` is not told.
        """
        key = (num_heads, key_cache.shape, key_cache.dtype)
        plan = self._plans.get(key)
        if plan is None:
            plan = self._plans[key] = _build_plan(self, num_heads, key_cache)
        return plan


def _blocks_for(span: SeqSpan, num_tokens: int, block_size: int) -> list[int]:
    needed = -(-num_tokens // block_size)
    if len(span.block_ids) < needed:
        raise ValueError(
            f"span needs {needed} blocks for {num_tokens} tokens but has {len(span.block_ids)}"
        )
    return list(span.block_ids[:needed])


def build_attention_metadata(
    spans: Sequence[SeqSpan], block_size: int, device: torch.device
) -> AttentionMetadata:
    """Turn the step's spans (flat-batch order, 1-token spans first) into layer-ready tensors.

    Everything is built on the host with a handful of vectorised ops and moved once.
    """
    if any(s.num_new_tokens < 1 or s.num_computed_tokens < 0 for s in spans):
        raise ValueError("every span needs num_new_tokens >= 1 and num_computed_tokens >= 0")
    num_decodes = 0
    while num_decodes < len(spans) and spans[num_decodes].num_new_tokens == 1:
        num_decodes += 1

    # Decode group: one padded block table and one length mask serve every layer.
    decode_lens = [s.num_computed_tokens + 1 for s in spans[:num_decodes]]
    max_blocks = -(-max(decode_lens, default=0) // block_size)
    table: list[int] = []
    decode_slots: list[int] = []
    for span, length in zip(spans[:num_decodes], decode_lens, strict=True):
        blocks = _blocks_for(span, length, block_size)
        table.extend(blocks)
        table.extend([blocks[0]] * (max_blocks - len(blocks)))
        last = length - 1
        decode_slots.append(blocks[last // block_size] * block_size + last % block_size)
    decode_mask = torch.zeros(num_decodes, max_blocks * block_size)
    if num_decodes:
        key_pos = torch.arange(max_blocks * block_size)
        beyond = key_pos[None, :] >= torch.tensor(decode_lens)[:, None]
        decode_mask.masked_fill_(beyond, float("-inf"))

    slot_parts = [torch.tensor(decode_slots, dtype=torch.int64)]
    prefills: list[PrefillChunk] = []
    start = num_decodes
    for span in spans[num_decodes:]:
        n, k = span.num_computed_tokens, span.num_new_tokens
        blocks = torch.tensor(_blocks_for(span, n + k, block_size), dtype=torch.int64)
        positions = torch.arange(n, n + k)
        slot_parts.append(blocks[positions // block_size] * block_size + positions % block_size)
        mask = None
        if n > 0:
            key_pos = torch.arange(len(blocks) * block_size)
            future = key_pos[None, :] > positions[:, None]
            mask = torch.zeros(k, len(key_pos)).masked_fill_(future, float("-inf"))
            mask = mask[None, None].to(device)
        prefills.append(
            PrefillChunk(
                query_start=start,
                query_end=start + k,
                num_cached_tokens=n,
                context_blocks=blocks.to(device) if n > 0 else None,
                attn_mask=mask,
            )
        )
        start += k

    return AttentionMetadata(
        block_size=block_size,
        num_tokens=start,
        slot_mapping=torch.cat(slot_parts).to(device),
        num_decodes=num_decodes,
        decode_block_table=torch.tensor(table, dtype=torch.int64).to(device),
        decode_max_blocks=max_blocks,
        decode_mask=decode_mask.to(device),
        decode_context_lens=decode_lens,
        prefills=prefills,
        max_context_len=max(
            [*decode_lens, *(c.num_cached_tokens + c.query_end - c.query_start for c in prefills)],
            default=0,
        ),
    )


def allocate_kv_caches(
    config: ModelConfig, num_blocks: int, block_size: int, dtype: torch.dtype, device: torch.device
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Per layer (K, V), each [num_kv_heads, num_blocks, block_size, head_dim].

    Zero-filled rather than empty: never-written slots then hold finite values, a second line
    of defence (after the padding rule above) against NaN leaking through masked lanes.
    """
    shape = (config.num_key_value_heads, num_blocks, block_size, config.head_dim)
    return [
        (
            torch.zeros(shape, dtype=dtype, device=device),
            torch.zeros(shape, dtype=dtype, device=device),
        )
        for _ in range(config.num_hidden_layers)
    ]


def _gather(cache: torch.Tensor, rows: torch.Tensor, batch: int) -> torch.Tensor:
    """Whole blocks of every kv head -> [kv_heads, batch, blocks_per_seq * block_size, head_dim]."""
    num_kv_heads, num_blocks, block_size, head_dim = cache.shape
    flat = cache.view(num_kv_heads * num_blocks, block_size * head_dim)
    return flat.index_select(0, rows).view(num_kv_heads, batch, -1, head_dim)


def _decode_attention(
    q: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    plan: _LayerPlan,
    scale: float,
) -> torch.Tensor:
    """One query per sequence over its whole context: q [B, heads, head_dim] -> same shape."""
    assert plan.decode_key_rows is not None
    batch, num_heads, head_dim = q.shape
    num_kv_heads = key_cache.shape[0]
    keys = _gather(key_cache, plan.decode_key_rows, batch)
    if plan.decode_value_rows is None:
        out = F.scaled_dot_product_attention(
            q.unsqueeze(2),  # [B, heads, 1, head_dim]
            keys.transpose(0, 1),
            _gather(value_cache, plan.decode_key_rows, batch).transpose(0, 1),
            attn_mask=plan.decode_bias,
            scale=scale,
            enable_gqa=True,
        )
        return out.squeeze(2)
    group = num_heads // num_kv_heads
    grouped_q = q.view(batch, num_kv_heads, group, head_dim).transpose(0, 1)
    # Scores leave the matmul in the model dtype (as in transformers' eager path); scale,
    # mask and softmax then run in fp32 (torch.add promotes to the fp32 bias).
    scores = torch.matmul(grouped_q, keys.transpose(-1, -2))  # [kv_heads, B, group, context]
    probs = torch.softmax(torch.add(plan.decode_bias, scores, alpha=scale), dim=-1)
    # The aten op directly: F.embedding_bag's Python checks cost ~10 us a layer.
    out, *_ = torch.embedding_bag(
        value_cache.view(-1, head_dim),
        plan.decode_value_rows,
        plan.decode_value_offsets,
        False,  # scale_grad_by_freq
        0,  # mode: sum
        False,  # sparse
        probs.to(q.dtype).view(-1),  # per_sample_weights
    )
    return out.view(num_kv_heads, batch, group, head_dim).transpose(0, 1).reshape(q.shape)


def paged_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    kv_cache: tuple[torch.Tensor, torch.Tensor],
    meta: AttentionMetadata,
    scale: float,
) -> torch.Tensor:
    """Write this step's K/V into the cache, then attend. Returns [T, num_heads, head_dim].

    q is [T, num_heads, head_dim]; k and v are [T, num_kv_heads, head_dim]. Strided views
    (slices of a fused qkv projection) are fine: nothing here needs them contiguous.
    """
    key_cache, value_cache = kv_cache
    num_kv_heads, num_blocks, block_size, head_dim = key_cache.shape
    slots = key_cache.view(num_kv_heads, num_blocks * block_size, head_dim)
    slots.index_copy_(1, meta.slot_mapping, k.transpose(0, 1))
    slots = value_cache.view(num_kv_heads, num_blocks * block_size, head_dim)
    slots.index_copy_(1, meta.slot_mapping, v.transpose(0, 1))
    plan = meta.plan(q.shape[1], key_cache)

    outputs: list[torch.Tensor] = []
    if meta.num_decodes:
        outputs.append(
            _decode_attention(q[: meta.num_decodes], key_cache, value_cache, plan, scale)
        )
    for chunk, rows, mask in zip(meta.prefills, plan.prefill_rows, plan.prefill_masks, strict=True):
        lo, hi = chunk.query_start, chunk.query_end
        query = q[lo:hi].transpose(0, 1).unsqueeze(0)  # [1, heads, k, head_dim]
        if rows is None:
            keys = k[lo:hi].transpose(0, 1).unsqueeze(0)
            values = v[lo:hi].transpose(0, 1).unsqueeze(0)
        else:
            keys = _gather(key_cache, rows, 1).transpose(0, 1)
            values = _gather(value_cache, rows, 1).transpose(0, 1)
        # Flash SDPA (fp32 scores inside, bf16 in and out) is the fastest exact choice for
        # many queries; enable_gqa keeps K/V unrepeated.
        out = F.scaled_dot_product_attention(
            query,
            keys,
            values,
            attn_mask=mask,
            is_causal=rows is None,
            scale=scale,
            enable_gqa=True,
        )
        outputs.append(out.squeeze(0).transpose(0, 1))
    if len(outputs) == 1:
        return outputs[0]
    return torch.cat(outputs) if outputs else q.new_empty(q.shape)
