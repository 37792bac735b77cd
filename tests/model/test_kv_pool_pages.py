"""The KV pool reads as zeros everywhere but is resident only where used: a large pool costs
nothing until its blocks are written (model/attention.py, allocate_kv_caches)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

from iterserve.model.attention import allocate_kv_caches
from iterserve.model.config import ModelConfig

MIB = 2**20


def shape(layers: int = 4, kv_heads: int = 2, head_dim: int = 64) -> ModelConfig:
    return ModelConfig(
        architecture="LlamaForCausalLM",
        vocab_size=100,
        hidden_size=kv_heads * head_dim,
        intermediate_size=256,
        num_hidden_layers=layers,
        num_attention_heads=kv_heads,
        num_key_value_heads=kv_heads,
        head_dim=head_dim,
        rms_norm_eps=1e-5,
        rope_theta=1e4,
        max_position_embeddings=512,
        tie_word_embeddings=True,
    )


def resident() -> int:
    status = Path("/proc/self/status").read_text()
    match = re.search(r"VmRSS:\s+(\d+) kB", status)
    assert match is not None
    return int(match.group(1)) * 1024


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.int8])
def test_the_pool_is_zeros_of_the_asked_shape_and_writable(dtype: torch.dtype) -> None:
    caches = allocate_kv_caches(shape(layers=2), 37, 16, dtype, torch.device("cpu"))
    width = 64 + 4 if dtype == torch.int8 else 64  # an int8 row carries its scale
    assert len(caches) == 2
    for k, v in caches:
        for cache in (k, v):
            assert cache.shape == (2, 37, 16, width) and cache.dtype == dtype
            assert cache.is_contiguous() and not cache.any()
    k, v = caches[0]
    k[1, 36, 15] = 3
    assert k[1, 36, 15].eq(3).all() and k.count_nonzero() == width
    assert not v.any() and not caches[1][0].any()  # every tensor has memory of its own


@pytest.mark.skipif(not Path("/proc/self/status").exists(), reason="reads Linux's VmRSS")
def test_a_large_pool_is_resident_only_where_written() -> None:
    config = shape(layers=8, kv_heads=4, head_dim=128)
    block_bytes = 2 * 8 * 4 * 128 * 2 * 16  # K and V, every layer, bf16, 16 tokens
    num_blocks = 2 * 2**30 // block_bytes  # 2 GiB
    before = resident()
    caches = allocate_kv_caches(config, num_blocks, 16, torch.bfloat16, torch.device("cpu"))
    allocated = resident()
    for k, v in caches:
        k[:, :64] = 1.0
        v[:, :64] = 1.0
    written = resident()
    assert allocated - before < 32 * MIB  # torch.zeros would have made all 2 GiB resident
    # 64 blocks are 4 MiB of K/V; the pages they share with their neighbours come along.
    assert 64 * block_bytes // 2 <= written - allocated < 64 * block_bytes + 32 * MIB
    assert not caches[-1][1][:, -1].any()  # an untouched block still reads as zeros
