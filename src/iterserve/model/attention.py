"""Paged attention for one ragged step over a block pool, and the op the layers call.

Rows are served in the runs attention_metadata.py describes: the C++ op (kernels/csrc/
paged_attention.cpp, reading the pool in place) where it runs, otherwise the torch decode
path below; then prefill chunks through flash SDPA. The torch paths are the reference the
C++ op is tested against.

Cache layout, per layer: K and V are each ``[num_kv_heads, num_blocks, block_size, head_dim]``
(with an int8 cache, rows of ``head_dim + 4`` bytes: model/kv_cache_format.py).
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
batch 32 x 256 tokens and at batch 8 x 1024 against gathering both. Prefill chunks (many
queries) use flash SDPA, which beat fp32 SDPA and grouped matmul there (both measured once,
no script). Every path is exact
in fp32. (benchmarks/attention_kernel.py sets these paths against the C++ op.)
"""

from __future__ import annotations

import contextlib
import math
import mmap
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from iterserve.model.attention_metadata import AttentionMetadata, chunk_mask, decode_mask
from iterserve.model.config import ModelConfig
from iterserve.model.kv_cache_format import (
    dequantize_rows,
    head_dim_of,
    is_quantized,
    quantize_rows,
    row_width,
)

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
    # matmul, [B, 1, 1, context] in the compute dtype for SDPA.
    decode_bias: torch.Tensor | None
    prefill_rows: list[torch.Tensor | None]
    prefill_masks: list[torch.Tensor | None]  # cast to the compute dtype


def _masks_for_window(
    meta: AttentionMetadata, window: int
) -> tuple[torch.Tensor, list[torch.Tensor | None]]:
    """The step's decode and prefill masks for a layer whose window is not the step's
    (Gemma's full-attention layers beside sliding ones)."""
    if window == meta.sliding_window:
        return meta.decode_mask, [c.attn_mask for c in meta.prefills]
    device = meta.decode_mask.device
    decode = decode_mask(meta.decode_context_lens, meta.decode_max_blocks, meta.block_size, window)
    prefill = []
    for c in meta.prefills:
        blocks = 0 if c.context_blocks is None else len(c.context_blocks)
        k = c.query_end - c.query_start
        mask = chunk_mask(c.num_cached_tokens, k, blocks, meta.block_size, window, c.attend_within)
        prefill.append(None if mask is None else mask.to(device))
    return decode.to(device), prefill


@dataclass(frozen=True)
class _LayerKind:
    """What a layer's plan depends on besides the step and the cache's shape and dtype."""

    num_heads: int
    dtype: torch.dtype  # of q and of the computation
    window: int  # the layer's sliding window (0: none)
    explicit: bool  # scores soft-capped, or sinks: attention through _attend_gathered


def _build_plan(meta: AttentionMetadata, key_cache: torch.Tensor, kind: _LayerKind) -> _LayerPlan:
    num_heads, dtype, window, explicit = kind.num_heads, kind.dtype, kind.window, kind.explicit
    num_kv_heads, num_blocks, block_size, _ = key_cache.shape
    head_dim = head_dim_of(key_cache)
    if block_size != meta.block_size:
        raise ValueError(f"cache blocks hold {block_size} tokens, metadata says {meta.block_size}")
    device = key_cache.device
    heads = torch.arange(num_kv_heads, device=device) * num_blocks

    def rows(blocks: torch.Tensor | None) -> torch.Tensor | None:
        return None if blocks is None else (heads[:, None] + blocks[None, :]).reshape(-1)

    decode_masks, prefill_masks = _masks_for_window(meta, window)
    key_rows = value_rows = value_offsets = bias = None
    batch = meta.num_decodes
    if batch:
        key_rows = rows(meta.decode_block_table)
        context = meta.decode_max_blocks * block_size
        gathered_bytes = 2 * batch * context * num_kv_heads * head_dim * dtype.itemsize
        # An int8 pool is always gathered (and dequantized): embedding_bag reads V in place;
        # so is an `explicit` (soft-capped or sinking) layer's, for _attend_gathered.
        small = gathered_bytes <= _SDPA_DECODE_MAX_BYTES
        if small or is_quantized(key_cache) or explicit:
            bias = decode_masks.view(batch, 1, 1, context).to(dtype)
        else:
            table = meta.decode_block_table.view(batch, meta.decode_max_blocks)
            in_block = torch.arange(block_size, device=device)
            slots = (table[:, :, None] * block_size + in_block).view(batch, 1, context)
            group = num_heads // num_kv_heads
            value_rows = heads[:, None, None, None] * block_size + slots[None]
            value_rows = value_rows.expand(num_kv_heads, batch, group, context).reshape(-1)
            value_offsets = torch.arange(0, value_rows.numel(), context, device=device)
            bias = decode_masks.view(1, batch, 1, context)
    return _LayerPlan(
        decode_key_rows=key_rows,
        decode_value_rows=value_rows,
        decode_value_offsets=value_offsets,
        decode_bias=bias,
        prefill_rows=[rows(c.context_blocks) for c in meta.prefills],
        prefill_masks=[None if m is None else m.to(dtype) for m in prefill_masks],
    )


def _plan(meta: AttentionMetadata, key_cache: torch.Tensor, kind: _LayerKind) -> _LayerPlan:
    """Gather rows and typed masks for this cache; the first layer builds, the rest reuse.

    They depend on the cache's shape and dtypes, which `build_attention_metadata` is not told,
    and on the layer's window and whether its scores are soft-capped (`kind`).
    """
    key = (kind, key_cache.shape, key_cache.dtype)
    plan = meta.plans.get(key)
    if plan is None:
        plan = meta.plans[key] = _build_plan(meta, key_cache, kind)
    assert isinstance(plan, _LayerPlan)
    return plan


def allocate_kv_caches(
    config: ModelConfig, num_blocks: int, block_size: int, dtype: torch.dtype, device: torch.device
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Per layer (K, V), each [num_kv_heads, num_blocks, block_size, head_dim] of `dtype`, the
    model's or int8 (then rows of head_dim + 4 bytes), with the layer's own heads (Gemma 4's
    full layers); a layer that shares an earlier layer's K/V holds that layer's pair.

    Zero-filled rather than empty: never-written slots then hold finite values, a second line
    of defence (after the padding rule above) against NaN leaking through masked lanes. On a
    CPU the zeros cost nothing until used (`_zeroed_pages`).
    """
    zeroed = _zeroed_pages if device.type == "cpu" else _zeroed_now
    # An LFM2 conv layer keeps a row of its convolution's input a token in its "K" (one head
    # of hidden_size, model/short_conv.py) and no V.
    conv_state = (1, num_blocks, block_size, row_width(config.hidden_size, dtype))
    caches: list[tuple[torch.Tensor, torch.Tensor]] = []
    for i in range(config.num_hidden_layers):
        if (source := config.layer_kv_source(i)) != i:  # Gemma 4: an earlier layer's
            caches.append(caches[source])
        elif config.layer_is_conv(i):
            empty = zeroed((0, num_blocks, block_size, 0), dtype, device)
            caches.append((zeroed(conv_state, dtype, device), empty))
        else:
            width = row_width(config.layer_head_dim(i), dtype)
            shape = (config.layer_kv_heads(i), num_blocks, block_size, width)
            caches.append((zeroed(shape, dtype, device), zeroed(shape, dtype, device)))
    return caches


def _zeroed_now(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    return torch.zeros(shape, dtype=dtype, device=device)


def _zeroed_pages(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A CPU tensor over an anonymous private mapping of its own. The kernel gives such a
    mapping's pages zero-filled (mmap(2): "its contents are initialized to zero") and only at
    first touch, so the pool reads as zeros everywhere while only blocks written or read
    are resident: --kv-cache-memory auto may reserve a large share of the machine that a
    small load never commits (benchmarks/kv_pool_memory.py measures it). torch.zeros would
    write, and so commit, every page at start-up; torch.empty gives no zeros."""
    nbytes = math.prod(shape) * dtype.itemsize
    if nbytes == 0:
        return _zeroed_now(shape, dtype, device)
    pages = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    # frombuffer keeps `pages` alive as long as the tensor (and its views) are; the mapping
    # is unmapped when the last goes.
    return torch.frombuffer(pages, dtype=dtype).view(shape)


def _gather(
    cache: torch.Tensor, rows: torch.Tensor, batch: int, dtype: torch.dtype
) -> torch.Tensor:
    """Whole blocks of every kv head -> [kv_heads, batch, blocks_per_seq * block_size, head_dim]
    of `dtype` (an int8 pool's rows dequantized)."""
    num_kv_heads, num_blocks, block_size, width = cache.shape
    flat = cache.view(num_kv_heads * num_blocks, block_size * width)
    gathered = flat.index_select(0, rows).view(num_kv_heads, batch, -1, width)
    return dequantize_rows(gathered, dtype) if is_quantized(cache) else gathered


def _store(cache: torch.Tensor, slot_mapping: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """This step's rows [T, kv_heads, head_dim] into their slots (quantized for an int8 pool);
    returns them as the pool now holds them, in the rows' dtype."""
    num_kv_heads, num_blocks, block_size, width = cache.shape
    slots = cache.view(num_kv_heads, num_blocks * block_size, width)
    stored = quantize_rows(rows) if is_quantized(cache) else rows
    slots.index_copy_(1, slot_mapping, stored.transpose(0, 1))
    return dequantize_rows(stored, rows.dtype) if is_quantized(cache) else rows


def _decode_attention(
    q: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    plan: _LayerPlan,
    scale: float,
    softcap: float,
    sinks: torch.Tensor | None,
) -> torch.Tensor:
    """One query per sequence over its whole context: q [B, heads, head_dim] -> same shape."""
    assert plan.decode_key_rows is not None
    batch, num_heads, head_dim = q.shape
    num_kv_heads = key_cache.shape[0]
    keys = _gather(key_cache, plan.decode_key_rows, batch, q.dtype)
    if plan.decode_value_rows is None:
        out = _attend_gathered(
            q.unsqueeze(2),  # [B, heads, 1, head_dim]
            keys.transpose(0, 1),
            _gather(value_cache, plan.decode_key_rows, batch, q.dtype).transpose(0, 1),
            plan.decode_bias,
            False,
            scale,
            softcap,
            sinks,
        )
        return out.squeeze(2)
    group = num_heads // num_kv_heads
    grouped_q = q.view(batch, num_kv_heads, group, head_dim).transpose(0, 1)
    # Scores leave the matmul in the model dtype (as in transformers' eager path); scale,
    # mask and softmax then run in fp32 (torch.add promotes to the fp32 bias).
    scores = torch.matmul(grouped_q, keys.transpose(-1, -2))  # [kv_heads, B, group, context]
    probs = torch.softmax(torch.add(plan.decode_bias, scores, alpha=scale), dim=-1)
    # The aten op directly: F.embedding_bag's Python checks cost ~10 us a layer
    # (measured once, no script).
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


def _attend_gathered(
    query: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    mask: torch.Tensor | None,
    causal: bool,
    scale: float,
    softcap: float,
    sinks: torch.Tensor | None,
) -> torch.Tensor:
    """query [N, heads, q, d] over keys/values [N, kv_heads, ctx, d]: flash SDPA, or where
    SDPA cannot express it the textbook form transformers' eager path computes, fp32 softmax:
    with `softcap` (Gemma 2: scores -> softcap * tanh(scores / softcap) before the mask), and
    with `sinks` (gpt-oss: one more logit per head [heads] in each softmax, with no value)."""
    if not softcap and sinks is None:
        return F.scaled_dot_product_attention(
            query, keys, values, attn_mask=mask, is_causal=causal, scale=scale, enable_gqa=True
        )
    group = query.shape[1] // keys.shape[1]
    keys, values = keys.repeat_interleave(group, 1), values.repeat_interleave(group, 1)
    scores = torch.matmul(query, keys.transpose(-1, -2)) * scale
    if softcap:
        scores = torch.tanh(scores / softcap) * softcap
    if causal:
        mask = torch.full(scores.shape[-2:], float("-inf"), device=scores.device).triu_(1)
    if mask is not None:
        scores = scores + mask
    if sinks is not None:
        sink = sinks.view(1, -1, 1, 1).expand(*scores.shape[:-1], 1)
        scores = torch.cat((scores.float(), sink), dim=-1)
    probs = torch.softmax(scores, dim=-1, dtype=torch.float32)
    if sinks is not None:
        probs = probs[..., :-1]
    return torch.matmul(probs.to(values.dtype), values)


def paged_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    kv_cache: tuple[torch.Tensor, torch.Tensor],
    meta: AttentionMetadata,
    scale: float,
    window: int | None = None,
    softcap: float = 0.0,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """Write this step's K/V into the cache, then attend. Returns [T, num_heads, head_dim].

    q is [T, num_heads, head_dim]; k and v are [T, num_kv_heads, head_dim]. Strided views
    (slices of a fused qkv projection) are fine: nothing here needs them contiguous.
    `window`: this layer's sliding window (0: none) when it is not the step's; `softcap`:
    the attention logit soft-cap (0: none); `sinks`: the layer's attention sinks, fp32
    [num_heads] (None: none).
    """
    key_cache, value_cache = kv_cache
    if meta.kernel is not None:
        raise ValueError("this step's metadata is for the C++ op: the layers call it directly")
    # A chunk attends its own K/V as the pool holds them (8-bit rounded in an int8 pool), as
    # the kernels read them.
    k = _store(key_cache, meta.slot_mapping, k)
    v = _store(value_cache, meta.slot_mapping, v)
    window = meta.sliding_window if window is None else window
    explicit = softcap > 0 or sinks is not None
    plan = _plan(meta, key_cache, _LayerKind(q.shape[1], q.dtype, window, explicit))

    outputs: list[torch.Tensor] = []
    if meta.num_decodes:
        outputs.append(
            _decode_attention(
                q[: meta.num_decodes], key_cache, value_cache, plan, scale, softcap, sinks
            )
        )
    for chunk, rows, mask in zip(meta.prefills, plan.prefill_rows, plan.prefill_masks, strict=True):
        lo, hi = chunk.query_start, chunk.query_end
        query = q[lo:hi].transpose(0, 1).unsqueeze(0)  # [1, heads, k, head_dim]
        if rows is None:
            keys = k[lo:hi].transpose(0, 1).unsqueeze(0)
            values = v[lo:hi].transpose(0, 1).unsqueeze(0)
        else:
            keys = _gather(key_cache, rows, 1, q.dtype).transpose(0, 1)
            values = _gather(value_cache, rows, 1, q.dtype).transpose(0, 1)
        # Flash SDPA (fp32 scores inside, bf16 in and out) is the fastest exact choice for
        # many queries; enable_gqa keeps K/V unrepeated.
        causal = rows is None and mask is None
        out = _attend_gathered(query, keys, values, mask, causal, scale, softcap, sinks)
        outputs.append(out.squeeze(0).transpose(0, 1))
    if len(outputs) == 1:
        return outputs[0]
    return torch.cat(outputs) if outputs else q.new_empty(q.shape)


# ---- the op the layers call ----------------------------------------------------------------


@dataclass
class _StepContext:
    meta: AttentionMetadata
    kv_caches: Sequence[tuple[torch.Tensor, torch.Tensor]]


_step: _StepContext | None = None


@contextlib.contextmanager
def attention_context(
    meta: AttentionMetadata, kv_caches: Sequence[tuple[torch.Tensor, torch.Tensor]]
) -> Iterator[None]:
    """Make this step's metadata and KV caches what `attend` reads, for one forward.

    They reach attention through this context rather than as arguments so that a compiled
    layer stack sees one opaque op with tensor arguments: the step's Python-side metadata
    (lists of chunks, block tables) never becomes part of the graph or its guards.
    """
    global _step
    previous, _step = _step, _StepContext(meta, kv_caches)
    try:
        yield
    finally:
        _step = previous


def current_step() -> tuple[AttentionMetadata, Sequence[tuple[torch.Tensor, torch.Tensor]]]:
    """The step `attention_context` holds: what the ops that read the cache (`attend`, the
    short convolution) see of it."""
    if _step is None:
        raise RuntimeError("a cache-reading op was called outside attention_context()")
    return _step.meta, _step.kv_caches


@torch.library.custom_op("iterserve::attend", mutates_args=())
def attend(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    layer: int,
    scale: float,
    window: int,
    softcap: float,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """Write layer `layer`'s new K/V for the current step into its cache, then attend.

    q [T, heads, head_dim]; k, v [T, kv_heads, head_dim] -> [T, heads, head_dim]. The cache
    write is invisible to the compiler on purpose (the cache is not an argument); nothing in
    a graph reads the cache except through this op, so no reordering can observe it.
    `window` (0: none), `softcap` (0: none) and `sinks` are the layer's (paged_attention).
    """
    if _step is None:
        raise RuntimeError("attend() called outside attention_context()")
    # Contiguous, as the fake promises: a compiled graph lays out what follows by it.
    kv_cache = _step.kv_caches[layer]
    out = paged_attention(q, k, v, kv_cache, _step.meta, scale, window, softcap, sinks)
    return out.contiguous()


@attend.register_fake
def _(q: torch.Tensor, *_: object) -> torch.Tensor:
    # The output is q's shape and dtype whatever the rest: the op's schema (from `attend`'s
    # signature) already checks the other arguments, so the fake does not restate them.
    return torch.empty_like(q, memory_format=torch.contiguous_format)
