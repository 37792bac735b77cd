"""The paged KV cache's bookkeeping: a pool of fixed-size blocks, per-request
block tables, reference counts and a prefix cache over full blocks.

Pure Python: the tensors live in the executor; this file only decides which
block holds which tokens.

Prefix caching follows vLLM: a full block is named by hash(parent block's hash,
its tokens), so a block's name covers everything before it. Freed blocks keep
their contents and their name until the pool needs them again; the free queue
is LRU, so the blocks used longest ago are reused first (core/free_blocks.py).

A name is the block's identity: two blocks with the same name share KV, so a
collision would serve one prompt another's cache (vLLM's CVE-2025-25183). The
default name is therefore sha256; Python's 64-bit `hash` is offered as a
faster choice for trusted workloads (benchmarks/prefix_hash.py times both; its
collisions are easy to construct: hash(0) == hash(2**61 - 1)).
"""

from __future__ import annotations

import hashlib
from array import array
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Literal, get_args

from iterserve.core.free_blocks import FreeBlockQueue
from iterserve.core.request import Request

BlockHash = bytes | int
PrefixHashAlgo = Literal["sha256", "builtin"]
PREFIX_HASH_ALGOS: tuple[str, ...] = get_args(PrefixHashAlgo)


@dataclass(frozen=True)
class KVCacheStats:
    num_blocks: int
    num_free_blocks: int
    num_cached_blocks: int
    prefix_queries: int  # prompt tokens looked up in the prefix cache at first admission
    prefix_hits: int  # of those, tokens found
    # Re-admissions after a preemption, kept apart: finding one's own freed blocks
    # again is recompute saved, not a prefix shared, and would flatter the hit rate.
    preempted_queries: int = 0
    preempted_hits: int = 0
    # Blocks taken at least once: their pages are resident, the rest of the pool only
    # reserved (an engine's pool is committed as it is written).
    num_written_blocks: int = 0

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - self.num_free_blocks

    @property
    def usage(self) -> float:
        return self.num_used_blocks / self.num_blocks if self.num_blocks else 0.0

    @property
    def prefix_hit_rate(self) -> float:
        return hit_rate(self.prefix_hits, self.prefix_queries)


def hit_rate(hits: int, queries: int) -> float:
    """Share of prompt tokens looked up in the prefix cache that were found (0 when none
    were looked up): an engine's, a fleet's summed counts, or a benchmark client's."""
    return hits / queries if queries else 0.0


def sha256_block_hash(parent_hash: BlockHash | None, tokens: Sequence[int]) -> bytes:
    """sha256(parent digest || token ids as int64). Unambiguous for one block size: the
    first block hashes block_size * 8 bytes, every later one 32 more."""
    parent = parent_hash if isinstance(parent_hash, bytes) else b""
    return hashlib.sha256(parent + array("q", tokens).tobytes()).digest()


def builtin_block_hash(parent_hash: BlockHash | None, tokens: Sequence[int]) -> int:
    return hash((parent_hash, tokens if isinstance(tokens, tuple) else tuple(tokens)))


_BLOCK_HASHES: dict[str, Callable[[BlockHash | None, Sequence[int]], BlockHash]] = {
    "sha256": sha256_block_hash,
    "builtin": builtin_block_hash,
}


def block_hash_chain(
    tokens: Sequence[int], block_size: int, algo: str, parent: BlockHash | None = None
) -> list[BlockHash]:
    """The names of the full blocks of `tokens` by hash function `algo`, each chained to
    the one before; the first to `parent` (the name of the block before them, if any)."""
    hashes: list[BlockHash] = []
    # Each full block as a tuple, cut in C (zip over one iterator drops a partial last).
    blocks = zip(*[iter(tokens)] * block_size, strict=False)
    if algo == "builtin":  # builtin_block_hash inlined: a large simulation's hot loop
        for block in blocks:
            parent = hash((parent, block))
            hashes.append(parent)
        return hashes
    hash_block = _BLOCK_HASHES[algo]
    for block in blocks:
        parent = hash_block(parent, block)
        hashes.append(parent)
    return hashes


def chain_seed(algo: str, lora_id: int) -> BlockHash | None:
    """The parent of a request's first block: none for the base model; otherwise a name of
    its adapter, so blocks computed under different adapters never share a name."""
    if not lora_id:
        return None
    if algo == "builtin":
        return hash(("lora", lora_id))
    return hashlib.sha256(b"lora" + lora_id.to_bytes(8, "little")).digest()


def keyed_parent(algo: str, parent: BlockHash | None, content: bytes) -> BlockHash:
    """The parent of the block holding a prompt's first position given as rows
    (Request.chain_key): the chain so far and the rows' content, so blocks from there on
    computed from other rows behind the same placeholder tokens never share a name (their
    K/V differ from the first layer on)."""
    if algo == "builtin":
        return hash(("rows", parent, content))
    before = b"" if parent is None else parent
    return hashlib.sha256(b"rows" + before + content).digest()


def break_seed(algo: str, serial: int) -> BlockHash:
    """The parent of the first block named after a chain break (core/kv_reuse.py): a name
    no prompt's own chain can reach, a new one each time."""
    if algo == "builtin":
        return hash(("reused", serial))
    return hashlib.sha256(b"reused" + serial.to_bytes(8, "little")).digest()


# The prefix cache's map is rebuilt when stale entries make it this many times the pool.
_STALE_FACTOR = 4


class KVCacheInvariantError(AssertionError):
    """The block pool's bookkeeping contradicts itself: a bug in whoever changed it."""


class KVCacheManager:
    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        enable_prefix_caching: bool = True,
        hash_algo: str = "sha256",
    ):
        if num_blocks < 1 or block_size < 1:
            raise ValueError("the KV cache needs at least one block of at least one token")
        if hash_algo not in _BLOCK_HASHES:
            raise ValueError(f"prefix hash must be one of {PREFIX_HASH_ALGOS}, got {hash_algo!r}")
        self.hash_algo = hash_algo
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        # Per block id: how many block tables hold it, and its name in the prefix cache.
        # Two flat lists rather than an object a block: a large simulation's pools do not
        # fit in cache, and each object was one more miss.
        self._refs = [0] * num_blocks
        self._names: list[BlockHash | None] = [None] * num_blocks
        # Blocks with ref_count 0, in the order they are reused.
        self._free = FreeBlockQueue(num_blocks)
        # Block hash -> block id. Evicting a block only clears its name: its entry here
        # stays, stale (the block bears another name or none), until the map is rebuilt
        # from the names at _STALE_FACTOR times the pool's size. A dict deletion per
        # evicted block cost a fleet simulation more than a rebuild every so often
        # (benchmarks/fleet_replay.py).
        self._cached: dict[BlockHash, int] = {}
        self._num_named = 0
        # How many of each request's leading blocks cache_full_blocks has been through.
        self._named_upto: dict[str, int] = {}
        self._prefix_queries = 0
        self._prefix_hits = 0
        self._preempted_queries = 0
        self._preempted_hits = 0

    # ---- queries -------------------------------------------------------------

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def ref_count(self, block_id: int) -> int:
        """How many block tables hold the block."""
        return self._refs[block_id]

    def block_name(self, block_id: int) -> BlockHash | None:
        """The block's name in the prefix cache; None while it holds nothing reusable."""
        return self._names[block_id]

    def stats(self) -> KVCacheStats:
        return KVCacheStats(
            num_blocks=self.num_blocks,
            num_free_blocks=len(self._free),
            num_cached_blocks=self._num_named,
            prefix_queries=self._prefix_queries,
            prefix_hits=self._prefix_hits,
            preempted_queries=self._preempted_queries,
            preempted_hits=self._preempted_hits,
            num_written_blocks=self.num_written_blocks,
        )

    @property
    def num_written_blocks(self) -> int:
        """Blocks taken at least once. The free queue hands out never-taken blocks in id
        order, after every freed block with nothing worth keeping but before the named ones:
        a pool with prefix caching is written through before it reuses a named block."""
        return self.num_blocks - self._free.num_never_taken

    def find_cached_prefix(self, request: Request) -> list[int]:
        """Blocks already holding a prefix of this request's tokens.

        At least one token is always left to compute, since the step that
        computes the last known token is the one that yields logits.
        """
        if not self.enable_prefix_caching:
            return []
        hashes = self._hashes_for(request)
        max_blocks = (request.num_tokens - 1) // self.block_size
        hits: list[int] = []
        for block_hash in hashes[:max_blocks]:
            block_id = self._cached.get(block_hash)
            if block_id is None or self._names[block_id] != block_hash:  # none, or stale
                break
            hits.append(block_id)
        return hits

    def cached_block(self, name: BlockHash) -> int | None:
        """The block bearing `name` in the prefix cache, if one still does."""
        block_id = self._cached.get(name)
        return block_id if block_id is not None and self._names[block_id] == name else None

    def block_names_of(self, request: Request) -> list[BlockHash]:
        """The names of the request's full blocks (of all its tokens, computed or not)."""
        return self._hashes_for(request)

    def record_prefix_lookup(
        self, num_queried: int, num_hit: int, after_preemption: bool = False
    ) -> None:
        """Counted once per admission, not per scheduling attempt."""
        if after_preemption:
            self._preempted_queries += num_queried
            self._preempted_hits += num_hit
        else:
            self._prefix_queries += num_queried
            self._prefix_hits += num_hit

    def check_invariants(self, block_tables: Iterable[Sequence[int]]) -> None:
        """Raise KVCacheInvariantError, naming every broken rule, unless the pool agrees
        with itself and with `block_tables` (every live request's block ids): each
        block's ref count is the number of tables holding it, a block is in the free
        queue exactly when its ref count is 0 (so free + used is the whole pool), and
        the prefix cache's map and the blocks' names point at each other. Costs
        O(blocks + table entries): for tests and debugging (the scheduler runs it after
        every update under ITERSERVE_DEBUG_INVARIANTS=1)."""
        problems: list[str] = []
        holders = [0] * self.num_blocks
        for table in block_tables:
            if len(set(table)) != len(table):
                problems.append(f"a block table lists a block twice: {list(table)}")
            for block_id in table:
                if 0 <= block_id < self.num_blocks:
                    holders[block_id] += 1
                else:
                    problems.append(f"a block table holds block {block_id}, not in the pool")
        queued = list(self._free)
        if len(queued) != len(self._free) or len(set(queued)) != len(queued):
            problems.append(
                f"the free queue counts {len(self._free)} blocks but lists {len(queued)} "
                f"({len(set(queued))} distinct)"
            )
        strays = [b for b in queued if not 0 <= b < self.num_blocks]
        if strays:
            problems.append(f"the free queue holds blocks not in the pool: {strays}")
        free = set(queued)
        for index, (ref_count, name) in enumerate(zip(self._refs, self._names, strict=True)):
            if ref_count != holders[index]:
                problems.append(
                    f"block {index} has ref_count {ref_count} but "
                    f"{holders[index]} block tables hold it"
                )
            is_free = index in free
            if is_free != (ref_count == 0):
                where = "in" if is_free else "missing from"
                problems.append(
                    f"block {index} with ref_count {ref_count} is {where} the free queue"
                )
            if name is not None and (problem := self._map_problem(index, name)):
                problems.append(problem)
        strays = [b for b in self._cached.values() if not 0 <= b < self.num_blocks]
        if strays:
            problems.append(f"the prefix cache maps names to blocks not in the pool: {strays}")
        num_named = sum(name is not None for name in self._names)
        if num_named != self._num_named:
            problems.append(f"the pool counts {self._num_named} named blocks, not {num_named}")
        if problems:
            raise KVCacheInvariantError("KV block pool inconsistent:\n  " + "\n  ".join(problems))

    def _map_problem(self, block_id: int, name: BlockHash) -> str | None:
        """What is wrong with the prefix cache's map for a block bearing `name`, if anything."""
        mapped = self._cached.get(name)
        if mapped != block_id:
            return f"block {block_id} is named, but the prefix cache maps its name to {mapped}"
        return None

    # ---- changes -------------------------------------------------------------

    def allocate(self, request: Request, num_new_tokens: int, cached: Sequence[int] = ()) -> bool:
        """Give `request` the blocks to compute `num_new_tokens` more tokens.

        `cached` are prefix-cache hits to attach first (only when the request
        holds no blocks yet); `num_new_tokens` counts tokens after them, and the
        caller advances `num_computed_tokens` past the hits. All or nothing: returns False and changes nothing
        when the pool is short.
        """
        assert not cached or not request.block_ids, "prefix hits attach to an empty block table"
        num_new_blocks = self._num_new_blocks(request, num_new_tokens, cached)
        if num_new_blocks > self._available(cached):
            return False
        for block_id in cached:
            self._take(block_id)
        request.block_ids.extend(cached)
        request.block_ids += self.take_free_blocks(num_new_blocks)
        return True

    def take_free_blocks(self, count: int) -> list[int]:
        """`count` free blocks (the caller checked there are), least recently used first,
        for a holder that puts them in block tables itself (allocate, and the simulator's
        decode cohort, sim/cohort_scheduler.py)."""
        taken = self._free.take(count)
        refs, names = self._refs, self._names  # hot in large simulations
        evicted = 0
        for block_id in taken:
            if names[block_id] is not None:  # evict: its contents are about to be overwritten
                names[block_id] = None
                evicted += 1
            refs[block_id] = 1
        self._num_named -= evicted
        return taken

    def num_free_beside(self, block_ids: Iterable[int]) -> int:
        """Free blocks left to allocate once `block_ids` (distinct) are taken: those of them
        no one holds leave the free queue."""
        return len(self._free) - sum(1 for b in block_ids if self._refs[b] == 0)

    def hold(self, block_ids: Sequence[int]) -> None:
        """Take a reference on each block outside any block table, so no allocation evicts
        it (the sources of a step's K/V copies while the step is planned: core/kv_reuse.py)."""
        for block_id in block_ids:
            self._take(block_id)

    def release(self, block_ids: Sequence[int]) -> None:
        """Drop references `hold` took; a block no one else holds goes back to the free
        queue's end with its name, as a freed prefix does."""
        freed: list[int] = []
        for block_id in block_ids:
            self._refs[block_id] -= 1
            if self._refs[block_id] == 0:
                freed.append(block_id)
            elif self._refs[block_id] < 0:
                raise KVCacheInvariantError(f"block {block_id} released more often than held")
        self._free.push_back(freed)

    def cache_full_blocks(self, request: Request) -> None:
        """Name the request's blocks that are now full of computed tokens."""
        if not self.enable_prefix_caching:
            return
        num_full = request.num_computed_tokens // self.block_size
        # Blocks before the watermark were named (or left as duplicates) in earlier steps:
        # looping over all of them every step made this O(context) per request per step.
        start = self._named_upto.get(request.request_id, 0)
        if start >= num_full:
            return
        hashes = self._hashes_for(request)
        self._named_upto[request.request_id] = num_full
        self._name_blocks(request, request.block_ids[start:num_full], hashes[start:num_full])

    def _name_blocks(self, request: Request, block_ids: list[int], hashes: list[BlockHash]) -> None:
        """Name the request's newly full blocks and map the names to them."""
        names, cached = self._names, self._cached
        named = 0
        for block_id, block_hash in zip(block_ids, hashes, strict=True):
            if names[block_id] is not None:
                continue
            holder = cached.setdefault(block_hash, block_id)  # one dict lookup a block
            if holder != block_id:
                if names[holder] == block_hash:
                    continue  # the same content computed twice: keep the first name
                cached[block_hash] = block_id  # a stale entry: the name is free again
            names[block_id] = block_hash
            named += 1
        self._num_named += named
        if len(cached) > _STALE_FACTOR * self.num_blocks:
            self._rebuild_map()

    def free(self, request: Request) -> None:
        """Drop the request's references. Its tail blocks are queued for reuse
        before its head, since a shared prefix is the part most worth keeping."""
        refs, names = self._refs, self._names
        keep: list[int] = []
        drop: list[int] = []  # nothing worth keeping in them: reused first
        for block_id in reversed(request.block_ids):
            holders = refs[block_id] - 1
            refs[block_id] = holders
            if not holders:
                (keep if names[block_id] is not None else drop).append(block_id)
            elif holders < 0:
                raise KVCacheInvariantError(f"block {block_id} freed more often than taken")
        self._queue_freed(request, keep, drop)

    def _queue_freed(self, request: Request, keep: list[int], drop: list[int]) -> None:
        """Queue the blocks the request held alone, named (`keep`) and not, tail first."""
        self._free.push_back(keep)
        self._free.push_front(drop)
        request.block_ids.clear()
        self._named_upto.pop(request.request_id, None)

    def reset_prefix_cache(self) -> int:
        """Forget every cached block no request holds; returns how many. Blocks in use
        keep their names, so their requests can still share them."""
        dropped = 0
        for block_id, name in enumerate(self._names):
            if name is not None and self._refs[block_id] == 0:
                self._names[block_id] = None
                dropped += 1
        self._num_named -= dropped
        self._rebuild_map()
        return dropped

    # ---- internals -----------------------------------------------------------

    def _rebuild_map(self) -> None:
        """The prefix cache's map from the names alone, without stale entries."""
        # Names are unique, so zip pairs each with its block; None pairs with the last
        # unnamed block and goes. In C: the pass over the names is per block.
        self._cached = dict(zip(self._names, range(self.num_blocks), strict=True))
        self._cached.pop(None, None)  # type: ignore[call-overload]

    def _num_new_blocks(self, request: Request, num_new_tokens: int, cached: Sequence[int]) -> int:
        num_tokens = request.num_computed_tokens + len(cached) * self.block_size + num_new_tokens
        return max(0, self.blocks_needed(num_tokens) - len(request.block_ids) - len(cached))

    def _available(self, cached: Sequence[int]) -> int:
        # A cached hit with no other user sits in the free queue; taking it uses it up.
        return len(self._free) - sum(1 for b in cached if self._refs[b] == 0)

    def _take(self, block_id: int) -> None:
        if self._refs[block_id] == 0:
            self._free.remove(block_id)
        self._refs[block_id] += 1

    def _hashes_for(self, request: Request) -> list[BlockHash]:
        """The request's hash chain (Request.block_hashes), extended over its full blocks;
        each block is hashed once in the request's life, however often it is looked up."""
        hashes = request.block_hashes
        start = len(hashes) * self.block_size
        if start + self.block_size <= request.num_tokens:
            parent = hashes[-1] if hashes else chain_seed(self.hash_algo, request.lora_id)
            broken_at = request.exact_upto // self.block_size  # core/kv_reuse.py
            if request.chain_break is not None and broken_at == len(hashes):
                parent = request.chain_break
            tokens = request.all_token_ids[start:]
            keyed = request.chain_key
            if keyed is not None and (first := keyed[0] // self.block_size) >= len(hashes):
                # The blocks before the first given row are named by their tokens alone.
                before = (first - len(hashes)) * self.block_size
                if before + self.block_size <= len(tokens):  # that row's block is full
                    chain = block_hash_chain(
                        tokens[:before], self.block_size, self.hash_algo, parent
                    )
                    hashes += chain
                    parent = keyed_parent(self.hash_algo, chain[-1] if chain else parent, keyed[1])
                    tokens = tokens[before:]
            hashes += block_hash_chain(tokens, self.block_size, self.hash_algo, parent)
        return hashes
