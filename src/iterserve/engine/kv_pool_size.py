"""How many KV blocks a pool gets, and why: the rule behind --num-kv-blocks,
--kv-cache-memory GiB and --kv-cache-memory auto, and the context length the pool allows.

Torch-free: the engine sizes its pool with it from a measurement (engine/available_memory.py),
the simulator (sim/fleet.py) from a hardware preset's memory, so both follow one rule.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable
from dataclasses import dataclass

from iterserve.config import CacheConfig, ConfigError

logger = logging.getLogger("iterserve.engine")

_GIB = 2**30


@dataclass(frozen=True)
class AvailableMemory:
    """Bytes a process could still take, and where the number comes from ("MemAvailable",
    "the cgroup /x's memory.max less its usage", a preset's memory, an estimate, ...);
    `reserved_elsewhere`: what was taken off for other engines' unwritten KV pools."""

    bytes: int
    source: str
    reserved_elsewhere: int = 0


@dataclass(frozen=True)
class KVPoolSize:
    """A pool's size and the numbers behind it, kept on the engine (`LLMEngine.kv_pool`) for
    /health, benchmarks and the start-up log."""

    num_blocks: int
    block_size: int
    bytes_per_token: float  # K and V of one token, all layers
    rule: str  # the setting that sized it: "--num-kv-blocks", "--kv-cache-memory", "auto"
    # --kv-cache-memory auto only: what was available, the share taken of it, the bytes
    # --max-num-seqs sequences of the full context need (the most the pool may take) with
    # those numbers in words ("64 sequences of 8192 tokens"), and whether that cap bound.
    available: AvailableMemory | None = None
    fraction: float | None = None
    cap_bytes: int | None = None
    cap_reason: str = ""
    capped: bool = False

    @property
    def tokens(self) -> int:
        return self.num_blocks * self.block_size

    @property
    def bytes(self) -> int:
        return int(self.tokens * self.bytes_per_token)

    def describe(self) -> str:
        """One line for the start-up log."""
        held = f"{self.num_blocks} blocks of {self.block_size} tokens ({self.tokens} tokens)"
        size = _readable(self.bytes)
        if self.available is None:
            return f"{size} ({self.rule}): {held}"
        available = f"{_readable(self.available.bytes)} available ({self.available.source})"
        share = f"{self.fraction:.0%} of {available}"
        if self.capped:
            share = f"what {self.cap_reason} need, less than {share}"
        return f"{size} (auto: {share}): {held}"

    def as_dict(self) -> dict[str, str]:
        """For /health: strings, as the model plan's entries are."""
        out = {
            "kv_cache_rule": self.rule,
            "kv_cache_bytes": str(self.bytes),
            "kv_cache_blocks": str(self.num_blocks),
            "kv_cache_tokens": str(self.tokens),
        }
        if self.available is not None:
            out["kv_cache_available_bytes"] = str(self.available.bytes)
            out["kv_cache_available_source"] = self.available.source
            out["kv_cache_reserved_elsewhere_bytes"] = str(self.available.reserved_elsewhere)
        return out


def _readable(num_bytes: float) -> str:
    return f"{num_bytes / _GIB:.2f} GiB" if num_bytes >= _GIB else f"{num_bytes / 2**20:.1f} MiB"


def num_kv_blocks(cache: CacheConfig, kv_bytes_per_token: float, memory_bytes: float) -> int:
    """KV blocks for a cache: the config's exact count, else as many as fit in
    `memory_bytes` (0 when not even one does)."""
    if cache.num_kv_blocks:
        return cache.num_kv_blocks
    return max(0, int(memory_bytes // (kv_bytes_per_token * cache.block_size)))


def size_kv_pool(
    cache: CacheConfig,
    bytes_per_token: float,
    max_num_seqs: int,
    max_context: int,
    available: Callable[[], AvailableMemory],
) -> KVPoolSize:
    """The pool for `cache`'s settings. `available` is asked only for --kv-cache-memory auto,
    which takes --kv-cache-memory-fraction of it, but never more blocks than `max_num_seqs`
    sequences of `max_context` tokens could hold at once: a tiny model gets what it can use,
    not a share of the machine. Raises ConfigError when auto leaves no block."""
    block_size = cache.block_size
    if cache.num_kv_blocks or cache.kv_cache_memory != "auto":
        rule = "--num-kv-blocks" if cache.num_kv_blocks else "--kv-cache-memory"
        memory = 0.0 if cache.num_kv_blocks else float(cache.kv_cache_memory) * _GIB
        blocks = num_kv_blocks(cache, bytes_per_token, memory)
        return KVPoolSize(blocks, block_size, bytes_per_token, rule)
    reading = available()
    fraction = cache.kv_cache_memory_fraction
    cap_blocks = max_num_seqs * math.ceil(max_context / block_size)
    block_bytes = bytes_per_token * block_size
    share_blocks = int(reading.bytes * fraction // block_bytes)
    pool = KVPoolSize(
        min(share_blocks, cap_blocks),
        block_size,
        bytes_per_token,
        "auto",
        reading,
        fraction,
        int(cap_blocks * block_bytes),
        f"{max_num_seqs} sequences of {max_context} tokens",
        capped=cap_blocks < share_blocks,
    )
    if pool.num_blocks < 1:
        raise ConfigError(
            f"--kv-cache-memory auto: {fraction:.0%} of the {_readable(reading.bytes)} "
            f"available ({reading.source}) holds no KV block of {_readable(block_bytes)}; "
            "free memory, raise --kv-cache-memory-fraction, or set --kv-cache-memory GiB or "
            "--num-kv-blocks"
        )
    return pool


def fit_max_model_len(asked: int | None, model_context: int, pool: KVPoolSize) -> int:
    """The longest sequence: --max-model-len, else the model's context (never past it), and no
    more than the pool holds. Cut to the pool when not given (logged); refused when given."""
    longest = min(asked or model_context, model_context)
    if longest <= pool.tokens:
        return longest
    if asked is not None:
        raise ConfigError(
            f"--max-model-len {asked} is more than the KV cache holds ({pool.tokens} tokens, "
            f"{pool.rule}): one request could never finish; lower --max-model-len or give the "
            "cache more memory (--kv-cache-memory, --kv-cache-memory-fraction, --num-kv-blocks)"
        )
    logger.info(
        "max model len: %d tokens, what the KV cache holds, not the model's %d "
        "(--kv-cache-memory or --max-model-len to choose)",
        pool.tokens,
        model_context,
    )
    return pool.tokens
