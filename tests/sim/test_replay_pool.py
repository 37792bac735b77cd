"""The replay's block pool (sim/replay_pool.py) decides as the core pool does: the same
operations on both leave the same names, free queue, block tables, hits and counts,
whatever the interleaving of admissions, steps, preemptions and finishes."""

from __future__ import annotations

import hypothesis.strategies as st
from hypothesis import given, settings

from iterserve.core.kv_cache import KVCacheManager, block_hash_chain
from iterserve.core.request import Request, RequestStatus
from iterserve.sampling_params import SamplingParams
from iterserve.sim.replay_pool import ReplayBlockPool

BLOCK = 4
PREFIXES = ([], [1, 2, 3, 4], [1, 2, 3, 4, 5, 6, 7, 8], [9, 9, 9, 9])


class Twin:
    """One request as both pools see it (each pool fills in its own Request)."""

    def __init__(self, index: int, tokens: list[int]) -> None:
        self.requests = [
            Request(str(index), tokens, SamplingParams(max_tokens=8), 0.0) for _ in range(2)
        ]
        chain = block_hash_chain(tokens, BLOCK, "builtin")
        for request in self.requests:  # known ahead, as the replay's feed gives them
            request.block_hashes = list(chain)
        self.admitted = False

    @property
    def first_name(self) -> int | None:
        chain = self.requests[0].block_hashes
        return int(chain[0]) if chain else None


def _admit(pool: KVCacheManager, request: Request, chunk: int) -> list[int] | None:
    """Prefix hits and a first chunk, as the scheduler admits: None if the pool is short."""
    cached = pool.find_cached_prefix(request)
    hit_tokens = len(cached) * BLOCK
    n = min(chunk, request.num_tokens - request.num_computed_tokens - hit_tokens)
    if not pool.allocate(request, n, cached):
        return None
    request.num_computed_tokens += hit_tokens + n
    request.status = RequestStatus.RUNNING
    pool.cache_full_blocks(request)
    return cached


def _step(pool: KVCacheManager, request: Request, chunk: int) -> bool:
    n = min(chunk, request.num_tokens - request.num_computed_tokens)
    if not pool.allocate(request, n):
        return False
    request.num_computed_tokens += n
    pool.cache_full_blocks(request)
    return True


def _end(pool: KVCacheManager, request: Request, preempt: bool) -> None:
    request.status = RequestStatus.PREEMPTED if preempt else RequestStatus.FINISHED_LENGTH
    pool.cache_full_blocks(request)
    pool.free(request)
    request.num_computed_tokens = 0


def _state(pool: KVCacheManager) -> object:
    return pool.stats(), list(pool._free), list(pool._names)


@settings(max_examples=300, deadline=None)
@given(
    prompts=st.lists(
        st.tuples(st.sampled_from(PREFIXES), st.lists(st.integers(0, 3), max_size=12)),
        min_size=1,
        max_size=10,
    ),
    ops=st.lists(
        st.tuples(st.sampled_from(["admit", "step", "finish", "preempt"]), st.integers(0, 9)),
        max_size=60,
    ),
    chunk=st.integers(1, 9),
)
def test_the_replay_pool_decides_as_the_core_pool(
    prompts: list[tuple[list[int], list[int]]], ops: list[tuple[str, int]], chunk: int
) -> None:
    twins = [Twin(i, prefix + tail) for i, (prefix, tail) in enumerate(prompts)]
    later = [
        t.first_name is not None and any(u.first_name == t.first_name for u in twins[i + 1 :])
        for i, t in enumerate(twins)
    ]
    pools = [
        KVCacheManager(12, BLOCK, hash_algo="builtin"),
        ReplayBlockPool(12, BLOCK, hash_algo="builtin"),
    ]
    arrived = 0
    for op, pick in ops:
        if op == "admit" and arrived < len(twins):  # the next request arrives
            replay_pool = pools[1]
            assert isinstance(replay_pool, ReplayBlockPool)
            replay_pool.admit_to_group(twins[arrived].requests[1], later[arrived])
            arrived += 1
            continue
        if not arrived:
            continue
        twin = twins[pick % arrived]
        done = twin.requests[0].status.finished
        if done:
            continue
        if op in ("admit", "step") and not twin.admitted:
            hits = [_admit(pool, r, chunk) for pool, r in zip(pools, twin.requests, strict=True)]
            assert hits[0] == hits[1]
            twin.admitted = hits[0] is not None
        elif op in ("admit", "step"):
            steps = [_step(pool, r, chunk) for pool, r in zip(pools, twin.requests, strict=True)]
            assert steps[0] == steps[1]
        elif twin.admitted:
            for pool, request in zip(pools, twin.requests, strict=True):
                _end(pool, request, preempt=op == "preempt")
            twin.admitted = False
        assert twin.requests[0].block_ids == twin.requests[1].block_ids
        assert _state(pools[0]) == _state(pools[1])
        live = [t.requests[1].block_ids for t in twins if t.admitted]
        pools[1].check_invariants(live)
