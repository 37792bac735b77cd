"""The C++ paged attention op against a plain torch reference over a shuffled, NaN-poisoned pool."""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

import pytest
import torch

from iterserve import kernels
from iterserve.model.kv_cache_format import dequantize_rows, quantize_rows

# Every test runs once per ISA variant of the kernels (conftest.kernel_test_isas).
pytestmark = pytest.mark.usefixtures("any_kernel_isa")


HUGE_BLOCK_ID = 2**31 - 1  # padding entries of block_tables: reading one would crash


@dataclass
class Case:
    q: torch.Tensor  # [T, heads, head_dim], a strided view unless asked otherwise
    key_cache: torch.Tensor
    value_cache: torch.Tensor
    block_tables: torch.Tensor
    seq_lens: torch.Tensor
    query_start_loc: torch.Tensor
    scale: float
    window: int
    softcap: float = 0.0  # Gemma 2's attention logit soft-cap (0: none)
    sinks: torch.Tensor | None = None  # gpt-oss's attention sinks, fp32 [heads]

    def run(self) -> torch.Tensor:
        return kernels.ops().paged_attention(
            self.q,
            self.key_cache,
            self.value_cache,
            self.block_tables,
            self.seq_lens,
            self.query_start_loc,
            self.scale,
            self.window,
            self.softcap,
            self.sinks,
        )


def make_case(
    contexts: list[int],
    q_lens: list[int],
    *,
    num_kv_heads: int = 2,
    group: int = 3,
    head_dim: int = 64,
    block_size: int = 16,
    dtype: torch.dtype = torch.float32,
    window: int = 0,
    strided_q: bool = True,
    seed: int = 0,
    int8_cache: bool = False,
) -> Case:
    """Sequences on scattered blocks of a pool whose every unused slot holds NaN (in an int8
    pool, rows of -1 bytes: each one's scale is a NaN)."""
    gen = torch.Generator().manual_seed(seed)
    num_heads = num_kv_heads * group
    blocks_per_seq = [-(-c // block_size) for c in contexts]
    num_blocks = sum(blocks_per_seq) + 3  # a few blocks nobody owns
    order = torch.randperm(num_blocks, generator=gen)
    if int8_cache:
        shape = (num_kv_heads, num_blocks, block_size, head_dim + 4)
        key_cache = torch.full(shape, -1, dtype=torch.int8)
        value_cache = torch.full(shape, -1, dtype=torch.int8)
    else:
        shape = (num_kv_heads, num_blocks, block_size, head_dim)
        key_cache = torch.full(shape, float("nan"), dtype=dtype)
        value_cache = torch.full(shape, float("nan"), dtype=dtype)
    tables = torch.full((len(contexts), max(blocks_per_seq) + 2), HUGE_BLOCK_ID, dtype=torch.int32)
    used = 0
    for s, (context, count) in enumerate(zip(contexts, blocks_per_seq, strict=True)):
        blocks = order[used : used + count]
        used += count
        tables[s, :count] = blocks.int()
        slots = torch.arange(context)
        ids, offsets = blocks[slots // block_size], slots % block_size
        for cache in (key_cache, value_cache):
            values = torch.randn(num_kv_heads, context, head_dim, generator=gen).to(dtype)
            cache[:, ids, offsets] = quantize_rows(values) if int8_cache else values
    total = sum(q_lens)
    if strided_q:  # q as the first slice of a fused qkv projection's output
        wide = torch.randn(total, (num_heads + 2 * num_kv_heads) * head_dim, generator=gen)
        q = wide.to(dtype)[:, : num_heads * head_dim].view(total, num_heads, head_dim)
        assert total == 1 or not q.is_contiguous()
    else:
        q = torch.randn(total, num_heads, head_dim, generator=gen).to(dtype)
    starts = torch.tensor([0, *q_lens]).cumsum(0).to(torch.int32)
    return Case(
        q=q,
        key_cache=key_cache,
        value_cache=value_cache,
        block_tables=tables,
        seq_lens=torch.tensor(contexts, dtype=torch.int32),
        query_start_loc=starts,
        scale=head_dim**-0.5,
        window=window,
    )


def on_16_bit_grid(q: torch.Tensor) -> torch.Tensor:
    """bf16 queries as the kernels score them against an int8 pool: per row, in fp32,
    round(q * (32767 / max|q|)) times max|q| / 32767."""
    q = q.float()
    top = q.abs().amax(-1, keepdim=True)
    inv = torch.where(top > 0, 32767.0 / top, torch.zeros_like(top))
    return torch.round(q * inv).double() * (top / 32767.0).double()


def reference(case: Case) -> tuple[torch.Tensor, torch.Tensor]:
    """Per sequence: gather the context by its block table, mask, softmax, all in fp64.
    Also sum_k p_k |v_k| per output element: how far rounding each weight p_k by a
    relative e can move the output (by at most e times it)."""
    num_kv_heads, _, block_size, _ = case.key_cache.shape
    group = case.q.shape[1] // num_kv_heads
    out = torch.empty(case.q.shape, dtype=torch.float64)
    spread = torch.empty(case.q.shape, dtype=torch.float64)
    for s, context in enumerate(case.seq_lens.tolist()):
        lo, hi = case.query_start_loc[s].item(), case.query_start_loc[s + 1].item()
        blocks = case.block_tables[s, : -(-context // block_size)].long()

        def gather(cache: torch.Tensor, blocks: torch.Tensor = blocks, n: int = context):
            rows = cache[:, blocks].reshape(num_kv_heads, -1, cache.shape[-1])[:, :n]
            if rows.dtype == torch.int8:  # the values the int8 rows stand for
                rows = dequantize_rows(rows, torch.float64)
            return rows.double().repeat_interleave(group, 0)  # [heads, context, head_dim]

        keys, values = gather(case.key_cache), gather(case.value_cache)
        queries = case.q[lo:hi].double()  # [rows, heads, head_dim]
        if case.key_cache.dtype == torch.int8 and case.q.dtype == torch.bfloat16:
            queries = on_16_bit_grid(case.q[lo:hi])
        scores = torch.einsum("rhd,hkd->hrk", queries, keys) * case.scale
        if case.softcap:
            scores = torch.tanh(scores / case.softcap) * case.softcap
        positions = torch.arange(context - (hi - lo), context)[:, None]
        key_pos = torch.arange(context)[None, :]
        allowed = key_pos <= positions
        if case.window > 0:
            allowed &= key_pos > positions - case.window
        scores = scores.masked_fill(~allowed, float("-inf"))
        if case.sinks is not None:  # one more logit per head, whose value is nothing
            sink = case.sinks.double().view(-1, 1, 1).expand(-1, hi - lo, 1)
            scores = torch.cat((scores, sink), dim=-1)
        probs = torch.softmax(scores, dim=-1)[..., :context]
        out[lo:hi] = torch.einsum("hrk,hkd->rhd", probs, values)
        spread[lo:hi] = torch.einsum("hrk,hkd->rhd", probs, values.abs())
    return out, spread


def assert_matches(out: torch.Tensor, case: Case) -> None:
    expected, spread = reference(case)
    assert out.shape == case.q.shape and out.dtype == case.q.dtype and out.is_contiguous()
    assert not out.isnan().any()
    error = (out.double() - expected).abs()
    if out.dtype == torch.float32:
        allowed = 1e-5 + 1e-5 * expected.abs()
    else:
        # One rounding of the output to bf16 (half an ulp, at most 2^-8 relative), fp32
        # slack, and for items of many queries the probabilities rounded to bf16 before
        # P.V (each weight by at most 2^-8 of itself: an output moves by 2^-8 sum p|v|).
        allowed = 2.0**-8 * expected.abs() + 2.0**-8 * spread + 1e-5
    excess = (error - allowed).max().item()
    assert excess <= 0, f"max error {error.max().item():.3g}, exceeds the bound by {excess:.3g}"


def run_on_threads(case: Case, threads: int) -> torch.Tensor:
    """case.run() with torch's thread count set to `threads` for the call."""
    saved = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        return case.run()
    finally:
        torch.set_num_threads(saved)


# Contexts from a single token to past several partitions (at most 512 keys each).
MIXED_CONTEXTS = [1, 9, 16, 17, 100, 700, 1100]
MIXED_Q_LENS = [1, 1, 8, 3, 1, 5, 2]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("group", [1, 3, 4])
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("block_size", [1, 16, 32])
def test_mixed_query_lengths_match_reference(
    block_size: int, head_dim: int, group: int, dtype: torch.dtype
) -> None:
    case = make_case(
        MIXED_CONTEXTS,
        MIXED_Q_LENS,
        group=group,
        head_dim=head_dim,
        block_size=block_size,
        dtype=dtype,
        seed=block_size + head_dim + group,
    )
    assert_matches(case.run(), case)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("batch", [1, 5, 33])
def test_decode_batches_match_reference(batch: int, dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(batch)
    contexts = torch.randint(1, 900, (batch,), generator=gen).tolist()
    case = make_case(contexts, [1] * batch, dtype=dtype, seed=batch)
    assert_matches(case.run(), case)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("window", [1, 7, 100, 600])
def test_sliding_window(window: int, dtype: torch.dtype) -> None:
    case = make_case(MIXED_CONTEXTS, MIXED_Q_LENS, dtype=dtype, window=window, seed=window)
    assert_matches(case.run(), case)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("softcap", [0.5, 50.0])
def test_logit_soft_cap(softcap: float, dtype: torch.dtype) -> None:
    """Gemma 2's scores -> softcap * tanh(scores / softcap) before the softmax: a cap below
    the scores' spread (0.5) flattens them, Gemma's own (50) barely; with a window too."""
    case = make_case(MIXED_CONTEXTS, MIXED_Q_LENS, dtype=dtype, seed=11)
    case.q.mul_(8)  # scores of several units, so that a cap of 0.5 changes them
    case.softcap = softcap
    assert_matches(case.run(), case)
    case.window = 100
    assert_matches(case.run(), case)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("window", [0, 100])
def test_attention_sinks(window: int, dtype: torch.dtype) -> None:
    """gpt-oss's sinks: each head's logit joins its queries' softmaxes and takes a share of
    the probability, none of the output. Sinks from far below the scores to far above (a
    query then nearly silent), over one partition and over several merged."""
    case = make_case(MIXED_CONTEXTS, MIXED_Q_LENS, dtype=dtype, window=window, seed=13)
    case.sinks = torch.tensor([-30.0, -1.0, 0.0, 0.5, 3.0, 12.0])
    assert_matches(case.run(), case)
    case.sinks = None
    without = case.run()
    case.sinks = torch.full((6,), -80.0)  # exp(-80) of the denominator: nothing changes
    torch.testing.assert_close(case.run(), without, rtol=2e-6, atol=1e-7)


def test_sliding_window_never_reads_blocks_before_the_window() -> None:
    """Blocks wholly outside every window may be freed: give them garbage ids."""
    case = make_case([900, 40], [2, 1], block_size=16, window=64, dtype=torch.bfloat16)
    expected = case.run()
    case.block_tables[0, : (900 - 2 - 64) // 16] = HUGE_BLOCK_ID
    torch.testing.assert_close(case.run(), expected, rtol=0, atol=0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("cached", [0, 300])
def test_long_query_over_a_cached_prefix(cached: int, dtype: torch.dtype) -> None:
    # 70 rows x group 3 exceed one query chunk, so rows are split and K/V read per chunk.
    case = make_case([cached + 70, 50, 1], [70, 1, 1], dtype=dtype, group=3, seed=cached)
    assert_matches(case.run(), case)


@pytest.mark.parametrize("head_dim", [32, 96, 256, 512])
def test_other_head_dims(head_dim: int) -> None:
    for dtype in (torch.float32, torch.bfloat16):
        case = make_case([5, 300], [1, 4], head_dim=head_dim, dtype=dtype, seed=head_dim)
        assert_matches(case.run(), case)


@pytest.mark.parametrize("threads", [1, 3])
def test_thread_counts_change_partitions_not_results(threads: int) -> None:
    case = make_case([1300, 260, 2], [1, 4, 2], dtype=torch.float32, seed=threads)
    assert_matches(run_on_threads(case, threads), case)


def test_a_step_whose_partial_sums_fill_several_waves() -> None:
    """Three prompts' rows in one step: 4,500 rows x 6 heads over up to 7 partitions of 256
    keys need ~77,000 partial slots of (64 + 2) floats, ~20 MB, so the groups run in three
    waves of 8 MiB (csrc/attention_plan.h `kWavePartialBytes`), each on the same slots, on two
    threads."""
    contexts = [1500, 1800, 1200]
    case = make_case(contexts, contexts, dtype=torch.bfloat16, seed=11)
    parts = sum(-(-(i + 1) // 256) for c in contexts for i in range(c))
    assert parts * 6 * (64 + 2) * 4 > 2 * (8 << 20)
    assert_matches(run_on_threads(case, 2), case)


def test_contiguous_q() -> None:
    case = make_case([33, 2], [3, 1], strided_q=False, dtype=torch.bfloat16)
    assert_matches(case.run(), case)


def test_empty_step() -> None:
    case = make_case([4], [1])
    empty = Case(
        case.q[:0],
        case.key_cache,
        case.value_cache,
        case.block_tables[:0],
        case.seq_lens[:0],
        torch.zeros(1, dtype=torch.int32),
        case.scale,
        0,
    )
    assert empty.run().shape == (0, *case.q.shape[1:])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("group", "head_dim"), [(1, 64), (3, 64), (4, 128), (3, 96), (8, 512)])
def test_int8_cache_matches_reference(group: int, head_dim: int, dtype: torch.dtype) -> None:
    """The kernels read an int8 pool's rows as scale * values (the reference dequantizes)."""
    case = make_case(
        MIXED_CONTEXTS,
        MIXED_Q_LENS,
        group=group,
        head_dim=head_dim,
        dtype=dtype,
        int8_cache=True,
        seed=group + head_dim,
    )
    assert_matches(case.run(), case)


def test_int8_cache_under_a_sliding_window_and_over_threads() -> None:
    case = make_case([1300, 260, 2], [1, 4, 2], window=100, int8_cache=True, seed=5)
    assert_matches(run_on_threads(case, 3), case)


def test_python_knows_the_head_sizes_built() -> None:
    """kernels.ATTENTION_HEAD_DIMS (by which model/builder.py sends a model to the op) is the
    build's own list (attention_plan.h `BuiltHeadDims`); the tests above attend in each."""
    assert kernels.ops().attention_head_dims() == list(kernels.ATTENTION_HEAD_DIMS)


def test_bad_inputs_are_refused() -> None:
    case = make_case([20, 3], [1, 1], dtype=torch.bfloat16)
    case.block_tables[0, 1] = HUGE_BLOCK_ID  # a block the context needs
    with pytest.raises(RuntimeError, match="outside the pool"):
        case.run()
    built = list(kernels.ATTENTION_HEAD_DIMS)
    for head_dim in (48, 160):  # not a multiple of 32; one not built
        odd = make_case([4], [1], head_dim=head_dim)
        with pytest.raises(RuntimeError, match=re.escape(f"must be one of {built}")):
            odd.run()
    short = make_case([4], [1])
    short.seq_lens[0] = 0
    with pytest.raises(RuntimeError, match="seq_len"):
        short.run()
    mixed = make_case([4], [1])
    mixed.q = mixed.q.to(torch.bfloat16)
    with pytest.raises(RuntimeError, match="share a dtype"):
        mixed.run()


def test_torch_compile_fullgraph_matches_eager() -> None:
    case = make_case([40, 7, 300], [1, 3, 1], dtype=torch.bfloat16)
    paged_attention = kernels.ops().paged_attention

    def attend(q: torch.Tensor, case: Case = case) -> torch.Tensor:
        out = paged_attention(
            q * 1.0,  # an op around it, so the graph is not just the call
            case.key_cache,
            case.value_cache,
            case.block_tables,
            case.seq_lens,
            case.query_start_loc,
            case.scale,
            case.window,
        )
        return out.flatten(1)

    compiled = torch.compile(attend, fullgraph=True, dynamic=False)
    eager = attend(case.q)
    torch.testing.assert_close(compiled(case.q), eager, rtol=0, atol=0)
    assert math.isfinite(eager.float().abs().sum().item())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_verify_rows_output_is_the_lone_decode_rows_bits(dtype: torch.dtype) -> None:
    """Speculative verify steps (1 + k rows of a sequence) beside other sequences give each
    row exactly the output its lone decode step gives: partitions do not follow the step's
    size, so greedy answers do not change under n-gram speculation."""
    k = 4
    contexts = [300, 600, 1030, 40]  # across partition boundaries; a short one beside
    case = make_case(contexts, [k + 1] * len(contexts), dtype=dtype, seed=7)
    verified = case.run()
    for s, context in enumerate(contexts):
        for i in range(k + 1):
            row = s * (k + 1) + i
            alone = Case(
                q=case.q[row : row + 1],
                key_cache=case.key_cache,
                value_cache=case.value_cache,
                block_tables=case.block_tables[s : s + 1],
                seq_lens=torch.tensor([context - k + i], dtype=torch.int32),
                query_start_loc=torch.tensor([0, 1], dtype=torch.int32),
                scale=case.scale,
                window=case.window,
            )
            assert torch.equal(alone.run()[0], verified[row]), (s, i)
