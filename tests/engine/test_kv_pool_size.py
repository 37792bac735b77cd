"""The KV pool's size: --kv-cache-memory auto's share of the memory left after the weights,
its cap, the explicit settings, and the context length the pool allows."""

from __future__ import annotations

import argparse
import logging
from pathlib import Path

import pytest
import torch

from iterserve.config import CacheConfig, ConfigError, add_engine_args, engine_config_from_args
from iterserve.engine import available_memory, llm_engine
from iterserve.engine.kv_pool_size import (
    AvailableMemory,
    KVPoolSize,
    fit_max_model_len,
    size_kv_pool,
)
from iterserve.engine.llm import LLM
from iterserve.sampling_params import InvalidRequestError, SamplingParams

MIB = 2**20
# The tiny Llama in fp32: 2 layers x 2 KV heads x 16 dims x (K and V) x 4 bytes a token.
TINY_BYTES_PER_TOKEN = 2 * 2 * 16 * 2 * 4
TINY_CONTEXT = 512


def reading(num_bytes: int) -> AvailableMemory:
    return AvailableMemory(num_bytes, "a fake reading")


def never_read() -> AvailableMemory:
    raise AssertionError("an explicit size must not read the available memory")


def test_auto_takes_its_share_of_the_available_memory() -> None:
    cache = CacheConfig(kv_cache_memory_fraction=0.25)
    pool = size_kv_pool(cache, 1000, 64, 8192, lambda: reading(100 * MIB))
    assert pool.num_blocks == int(0.25 * 100 * MIB // (1000 * 16))
    assert pool.rule == "auto" and not pool.capped
    assert pool.available == reading(100 * MIB) and pool.fraction == 0.25
    assert pool.describe().startswith(f"{pool.bytes / MIB:.1f} MiB (auto: 25% of 100.0 MiB")
    assert f"({pool.tokens} tokens)" in pool.describe()


def test_auto_is_capped_at_what_the_sequences_could_ever_use() -> None:
    # 4 sequences of 100 tokens: 7 blocks of 16 each, however much memory there is.
    pool = size_kv_pool(CacheConfig(), 1000, 4, 100, lambda: reading(2**40))
    assert pool.num_blocks == 4 * 7 and pool.capped
    assert pool.cap_bytes == 4 * 7 * 16 * 1000
    assert "what 4 sequences of 100 tokens need, less than 50% of 1024.00 GiB" in pool.describe()


@pytest.mark.parametrize(
    ("settings", "blocks", "rule"),
    [
        ({"kv_cache_memory": 0.5}, 2**29 // (1000 * 16), "--kv-cache-memory"),
        ({"kv_cache_memory": 0.5, "num_kv_blocks": 7}, 7, "--num-kv-blocks"),
        ({"num_kv_blocks": 9}, 9, "--num-kv-blocks"),
    ],
)
def test_explicit_sizes_are_taken_as_given(settings: dict, blocks: int, rule: str) -> None:
    # No cap either: a number of GiB or blocks is the user's to choose.
    pool = size_kv_pool(CacheConfig(**settings), 1000, 1, 16, never_read)
    assert (pool.num_blocks, pool.rule, pool.available) == (blocks, rule, None)


def test_auto_with_no_room_for_one_block_names_the_flags() -> None:
    with pytest.raises(ConfigError, match="--kv-cache-memory auto.*--kv-cache-memory-fraction"):
        size_kv_pool(CacheConfig(), 1000, 4, 100, lambda: reading(16_000))


def pool_of(num_blocks: int) -> KVPoolSize:
    return KVPoolSize(num_blocks, 16, 1000, "--num-kv-blocks")


def test_max_model_len_defaults_to_the_model_s_capped_by_the_pool(
    caplog: pytest.LogCaptureFixture,
) -> None:
    assert fit_max_model_len(None, 512, pool_of(100)) == 512
    assert fit_max_model_len(300, 512, pool_of(100)) == 300
    assert fit_max_model_len(4096, 512, pool_of(100)) == 512  # never past the model's
    assert not caplog.records
    with caplog.at_level(logging.INFO, logger="iterserve.engine"):
        assert fit_max_model_len(None, 512, pool_of(10)) == 160
    assert "max model len: 160 tokens, what the KV cache holds, not the model's 512" in caplog.text


def test_an_explicit_max_model_len_over_the_pool_is_refused() -> None:
    with pytest.raises(ConfigError, match=r"--max-model-len 400 .* holds \(160 tokens"):
        fit_max_model_len(400, 512, pool_of(10))


def test_the_flags_parse_auto_or_gib() -> None:
    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    for given, expected in ((["--kv-cache-memory", "2.5"], 2.5), ([], "auto")):
        config = engine_config_from_args(parser.parse_args(given))
        assert config.cache.kv_cache_memory == expected
    config = engine_config_from_args(parser.parse_args(["--kv-cache-memory-fraction", "0.8"]))
    assert config.cache.kv_cache_memory_fraction == 0.8
    with pytest.raises(SystemExit):
        parser.parse_args(["--kv-cache-memory", "lots"])
    for bad in ({"kv_cache_memory": 0}, {"kv_cache_memory": "2"}, {"kv_cache_memory": True}):
        with pytest.raises(ConfigError, match="--kv-cache-memory must be auto or a positive"):
            CacheConfig(**bad)  # type: ignore[arg-type]
    for fraction in (0.0, 1.5, float("nan")):
        with pytest.raises(ConfigError, match="--kv-cache-memory-fraction"):
            CacheConfig(kv_cache_memory_fraction=fraction)


# ---- through the engine ----------------------------------------------------------------


def test_the_engine_sizes_auto_from_the_memory_left_after_building_the_model(
    tiny_llama_dir: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """Built, then measured, then allocated; a measurement too small for the model's context
    cuts --max-model-len to what the pool holds, and a request past it is refused."""
    order: list[str] = []
    build_model, allocate = llm_engine.build_model, llm_engine.allocate_kv_caches

    def built(*args: object, **kwargs: object) -> object:
        out = build_model(*args, **kwargs)  # type: ignore[arg-type]
        order.append("built")
        return out

    def measured(device: torch.device) -> AvailableMemory:
        order.append("measured")
        return reading(2 * 20 * 16 * TINY_BYTES_PER_TOKEN)  # half of it: 20 blocks

    def allocated(*args: object) -> object:
        order.append("allocated")
        return allocate(*args)  # type: ignore[arg-type]

    monkeypatch.setattr(llm_engine, "build_model", built)
    monkeypatch.setattr(available_memory, "measure", measured)
    monkeypatch.setattr(llm_engine, "allocate_kv_caches", allocated)
    with caplog.at_level(logging.INFO, logger="iterserve.engine"):
        engine = LLM(str(tiny_llama_dir), dtype="float32", compile=False).engine
    assert order == ["built", "measured", "allocated"]
    assert engine.kv_pool.num_blocks == 20 and engine.kv_pool.rule == "auto"
    assert engine.kv_pool.available == reading(2 * 20 * 16 * TINY_BYTES_PER_TOKEN)
    assert engine.scheduler.kv_cache_stats().num_blocks == 20
    assert engine.max_model_len == 320
    assert "max model len: 320 tokens, what the KV cache holds" in caplog.text
    assert "KV cache: 0.2 MiB (auto: 50% of 0.3 MiB available (a fake reading)): 20 blocks" in (
        caplog.text
    )
    with pytest.raises(
        InvalidRequestError, match="maximum context length is 320 tokens"
    ) as refused:
        engine.add_request([5] * 300, SamplingParams(max_tokens=21))
    assert refused.value.param == "max_tokens"


def test_auto_gives_a_tiny_model_what_its_sequences_can_use(tiny_llama_dir: Path) -> None:
    engine = LLM(str(tiny_llama_dir), dtype="float32", compile=False, max_num_seqs=3).engine
    # The real measurement: this machine has far more than 3 x 512 tokens of the tiny model.
    assert engine.kv_pool.capped and engine.kv_pool.available is not None
    assert engine.kv_pool.num_blocks == 3 * TINY_CONTEXT // 16
    assert engine.kv_pool.bytes_per_token == TINY_BYTES_PER_TOKEN
    assert engine.max_model_len == TINY_CONTEXT


def test_explicit_memory_and_blocks_are_honoured(
    tiny_llama_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(available_memory, "measure", lambda device: never_read())
    gib = LLM(str(tiny_llama_dir), dtype="float32", compile=False, kv_cache_memory=0.001).engine
    assert gib.kv_pool.num_blocks == int(0.001 * 2**30 // (16 * TINY_BYTES_PER_TOKEN))
    assert gib.kv_pool.rule == "--kv-cache-memory" and gib.max_model_len == TINY_CONTEXT
    blocks = LLM(
        str(tiny_llama_dir), dtype="float32", compile=False, num_kv_blocks=10, max_model_len=100
    ).engine
    assert blocks.scheduler.kv_cache_stats().num_blocks == 10 and blocks.max_model_len == 100
    with pytest.raises(ConfigError, match="--max-model-len 200"):
        LLM(
            str(tiny_llama_dir), dtype="float32", compile=False, num_kv_blocks=10, max_model_len=200
        )
