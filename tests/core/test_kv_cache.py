"""The block pool under random sequences of operations (hypothesis state machine)."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable

import hypothesis.strategies as st
import pytest
from hypothesis import settings
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from iterserve.core.free_blocks import FreeBlockQueue
from iterserve.core.kv_cache import KVCacheInvariantError, KVCacheManager, builtin_block_hash
from iterserve.core.request import Request
from iterserve.sampling_params import SamplingParams

BLOCK = 4


def make_request(rid: str, tokens: list[int]) -> Request:
    return Request(rid, tokens, SamplingParams(max_tokens=8), arrival_time=0.0)


class BlockPoolMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.kv = KVCacheManager(num_blocks=24, block_size=BLOCK, enable_prefix_caching=True)
        self.live: dict[str, Request] = {}
        self.counter = 0
        self.ever_held: set[int] = set()

    @rule(
        prefix=st.sampled_from([[], [1, 2, 3, 4], [1, 2, 3, 4, 5, 6, 7, 8], [9, 9, 9, 9]]),
        tail=st.lists(st.integers(0, 5), min_size=1, max_size=14),
    )
    def admit(self, prefix: list[int], tail: list[int]) -> None:
        """A new request: attach prefix hits, allocate its first chunk."""
        self.counter += 1
        request = make_request(f"r{self.counter}", prefix + tail)
        cached = self.kv.find_cached_prefix(request)
        num_cached = len(cached) * BLOCK
        assert num_cached < request.num_tokens
        for block_id in cached:  # a hit really holds these tokens' name
            assert self.kv.block_name(block_id) is not None
        chunk = min(request.num_tokens - num_cached, 6)
        if self.kv.allocate(request, chunk, cached):
            request.num_computed_tokens = num_cached + chunk
            self.kv.cache_full_blocks(request)
            self.live[request.request_id] = request
        else:
            assert not request.block_ids

    @precondition(lambda self: self.live)
    @rule(data=st.data())
    def step(self, data: st.DataObject) -> None:
        """A running request computes more: the rest of its prompt, or a new token."""
        request = self.live[data.draw(st.sampled_from(sorted(self.live)))]
        if request.num_computed_tokens == request.num_tokens:
            request.append_output_tokens([data.draw(st.integers(0, 5))], [0.0])
        n = request.num_tokens - request.num_computed_tokens
        if self.kv.allocate(request, n):
            request.num_computed_tokens += n
            self.kv.cache_full_blocks(request)
            assert len(request.block_ids) == self.kv.blocks_needed(request.num_computed_tokens)

    @precondition(lambda self: self.live)
    @rule(data=st.data())
    def release(self, data: st.DataObject) -> None:
        """A request finishes, or is preempted (blocks freed, tokens kept for later): the
        pool sees the same."""
        request = self.live.pop(data.draw(st.sampled_from(sorted(self.live))))
        self.kv.free(request)
        request.num_computed_tokens = 0
        assert not request.block_ids

    @invariant()
    def pool_is_consistent(self) -> None:
        self.kv.check_invariants(request.block_ids for request in self.live.values())

    @invariant()
    def written_blocks_are_those_ever_held(self) -> None:
        """What the engine reports as the pool's resident part: every block a request has
        held, and no other (a rule frees blocks only after the invariants saw them held)."""
        for request in self.live.values():
            self.ever_held.update(request.block_ids)
        written = self.kv.stats().num_written_blocks
        assert self.ever_held == set(range(written))

    def teardown(self) -> None:
        for request in self.live.values():
            self.kv.free(request)
        assert self.kv.num_free_blocks == self.kv.num_blocks, "every block back in the pool"


TestBlockPool = BlockPoolMachine.TestCase
TestBlockPool.settings = settings(max_examples=150, stateful_step_count=40, deadline=None)


def test_shared_prefix_shares_blocks_and_lru_keeps_them() -> None:
    kv = KVCacheManager(num_blocks=6, block_size=BLOCK)
    first = make_request("a", [1, 2, 3, 4, 5, 6, 7, 8, 9])
    assert kv.allocate(first, first.num_tokens)
    first.num_computed_tokens = first.num_tokens
    kv.cache_full_blocks(first)
    kv.free(first)  # blocks stay cached with ref count 0

    second = make_request("b", [1, 2, 3, 4, 5, 6, 7, 8, 42, 43])
    cached = kv.find_cached_prefix(second)
    assert len(cached) == 2 and kv.ref_count(cached[0]) == 0
    assert kv.allocate(second, second.num_tokens - 8, cached)
    assert second.block_ids[:2] == cached
    assert kv.stats().num_used_blocks == 3


def test_full_hit_still_computes_the_last_token() -> None:
    kv = KVCacheManager(num_blocks=4, block_size=BLOCK)
    first = make_request("a", [1, 2, 3, 4, 5, 6, 7, 8])
    assert kv.allocate(first, 8)
    first.num_computed_tokens = 8
    kv.cache_full_blocks(first)
    again = make_request("b", [1, 2, 3, 4, 5, 6, 7, 8])
    assert len(kv.find_cached_prefix(again)) == 1  # the second block holds the last token


def test_allocation_is_all_or_nothing() -> None:
    kv = KVCacheManager(num_blocks=2, block_size=BLOCK)
    request = make_request("a", list(range(12)))
    assert not kv.allocate(request, 12)
    assert request.block_ids == [] and kv.num_free_blocks == 2


def test_eviction_takes_uncached_then_least_recently_used() -> None:
    kv = KVCacheManager(num_blocks=3, block_size=BLOCK)
    old = make_request("old", [1, 1, 1, 1])
    assert kv.allocate(old, 4)
    old.num_computed_tokens = 4
    kv.cache_full_blocks(old)
    kv.free(old)
    newer = make_request("new", [2, 2, 2, 2])
    assert kv.allocate(newer, 4)
    newer.num_computed_tokens = 4
    kv.cache_full_blocks(newer)
    kv.free(newer)
    # One fresh block remains; a 2-block request takes it and then evicts the oldest cached.
    taker = make_request("t", list(range(10, 18)))
    assert kv.allocate(taker, 8)
    assert kv.find_cached_prefix(make_request("x", [1, 1, 1, 1, 9])) == []
    assert len(kv.find_cached_prefix(make_request("y", [2, 2, 2, 2, 9]))) == 1


def _computed(kv: KVCacheManager, request_id: str, tokens: list[int]) -> None:
    """Run a request's prompt through the pool and free it, leaving its blocks cached."""
    request = make_request(request_id, tokens)
    assert kv.allocate(request, request.num_tokens)
    request.num_computed_tokens = request.num_tokens
    kv.cache_full_blocks(request)
    kv.free(request)


@pytest.mark.parametrize("algo, collides", [("builtin", True), ("sha256", False)])
def test_a_hash_collision_shares_kv_only_with_the_weak_hash(algo: str, collides: bool) -> None:
    # Python hashes ints modulo 2**61 - 1, so these two blocks differ yet hash alike.
    kv = KVCacheManager(num_blocks=8, block_size=BLOCK, hash_algo=algo)
    _computed(kv, "victim", [0, 1, 2, 3, 9])
    attacker = make_request("attacker", [2**61 - 1, 1, 2, 3, 9])
    assert bool(kv.find_cached_prefix(attacker)) == collides


def test_sha256_is_the_default_and_chains_parent_digests() -> None:
    import hashlib
    from array import array

    kv = KVCacheManager(num_blocks=8, block_size=BLOCK)
    _computed(kv, "a", [1, 2, 3, 4, 5, 6, 7, 8, 9])
    first = hashlib.sha256(array("q", [1, 2, 3, 4]).tobytes()).digest()
    second = hashlib.sha256(first + array("q", [5, 6, 7, 8]).tobytes()).digest()
    assert set(kv._cached) == {first, second}


def _pool_with_a_shared_prefix() -> tuple[KVCacheManager, list[Request]]:
    kv = KVCacheManager(num_blocks=8, block_size=BLOCK)
    requests = []
    for rid in ("a", "b"):
        request = make_request(rid, [1, 2, 3, 4, 5, 6])
        cached = kv.find_cached_prefix(request)
        assert kv.allocate(request, request.num_tokens - len(cached) * BLOCK, cached)
        request.num_computed_tokens = request.num_tokens
        kv.cache_full_blocks(request)
        requests.append(request)
    assert requests[0].block_ids[0] == requests[1].block_ids[0], "the prefix is shared"
    kv.check_invariants(r.block_ids for r in requests)
    return kv, requests


@pytest.mark.parametrize(
    ("corrupt", "message"),
    [
        (
            lambda kv, reqs: kv._refs.__setitem__(reqs[0].block_ids[0], 1),
            "has ref_count 1 but 2 block tables hold it",
        ),
        (
            lambda kv, reqs: kv._free.remove(7),
            "block 7 with ref_count 0 is missing from the free queue",
        ),
        (
            lambda kv, reqs: kv._free.push_back([reqs[1].block_ids[-1]]),
            "is in the free queue",
        ),
        (
            lambda kv, reqs: kv._cached.clear(),
            "is named, but the prefix cache maps its name to None",
        ),
        (
            lambda kv, reqs: kv._names.__setitem__(reqs[0].block_ids[0], None),
            "the pool counts 1 named blocks, not 0",  # a map entry may be stale; a count not
        ),
        (lambda kv, reqs: reqs[1].block_ids.append(reqs[1].block_ids[0]), "lists a block twice"),
    ],
    ids=["ref-count", "lost-free-block", "used-block-free", "map-lost", "name-lost", "twice"],
)
def test_a_corrupted_pool_fails_its_invariant_check(
    corrupt: Callable[[KVCacheManager, list[Request]], object], message: str
) -> None:
    kv, requests = _pool_with_a_shared_prefix()
    corrupt(kv, requests)
    with pytest.raises(KVCacheInvariantError, match="KV block pool inconsistent") as failure:
        kv.check_invariants(r.block_ids for r in requests)
    assert message in str(failure.value)


NUM_QUEUED = 64


class FreeQueueMachine(RuleBasedStateMachine):
    """FreeBlockQueue against the OrderedDict it replaced (core/free_blocks.py): the same
    blocks, reused in the same order, through takes long enough to compact its list."""

    def __init__(self) -> None:
        super().__init__()
        self.queue = FreeBlockQueue(NUM_QUEUED)
        self.model: OrderedDict[int, None] = OrderedDict.fromkeys(range(NUM_QUEUED))
        self.held: list[int] = []

    @rule(count=st.integers(1, NUM_QUEUED))
    def take(self, count: int) -> None:
        count = min(count, len(self.model))
        expected = [self.model.popitem(last=False)[0] for _ in range(count)]
        assert self.queue.take(count) == expected
        self.held += expected

    @precondition(lambda self: self.held)
    @rule(data=st.data(), front=st.booleans())
    def give_back(self, data: st.DataObject, front: bool) -> None:
        block_id = self.held.pop(data.draw(st.integers(0, len(self.held) - 1)))
        self.model[block_id] = None
        if front:
            self.model.move_to_end(block_id, last=False)
            self.queue.push_front([block_id])
        else:
            self.queue.push_back([block_id])

    @precondition(lambda self: self.model)
    @rule(data=st.data())
    def take_out_of_turn(self, data: st.DataObject) -> None:
        block_id = data.draw(st.sampled_from(list(self.model)))
        del self.model[block_id]
        self.queue.remove(block_id)
        self.held.append(block_id)

    @invariant()
    def same_order(self) -> None:
        assert list(self.queue) == list(self.model)
        assert len(self.queue) == len(self.model)


TestFreeQueue = FreeQueueMachine.TestCase
TestFreeQueue.settings = settings(max_examples=60, stateful_step_count=60, deadline=None)


def test_free_queue_compacts_and_keeps_its_order() -> None:
    queue = FreeBlockQueue(8)
    model = OrderedDict.fromkeys(range(8))
    for round_ in range(6000):  # ~20k entries pass the head, past the compaction point
        taken = queue.take(3)
        assert taken == [model.popitem(last=False)[0] for _ in range(3)]
        if round_ % 7 == 0:
            queue.remove(next(iter(queue)))
            taken.append(model.popitem(last=False)[0])
        queue.push_back(taken[::-1])
        model.update(dict.fromkeys(taken[::-1]))
    assert list(queue) == list(model)
    assert len(queue._back) < 10_000, "the consumed head was dropped"


def test_never_taken_blocks_are_counted_through_compaction() -> None:
    """What the pool reports as written (KVCacheStats.num_written_blocks) comes from the
    queue's count of blocks never taken, across the compaction of its list."""
    queue = FreeBlockQueue(10_000)
    taken: set[int] = set()
    held: list[int] = []
    compacted = False
    for round_ in range(3000):
        got = queue.take(4)
        taken.update(got)
        held += got
        if round_ >= 1400:  # blocks come back: named ones behind those never taken
            queue.push_back(held[:3])
            queue.push_front(held[3:4])
            del held[:4]
        compacted = compacted or (queue._head == 0 and len(taken) < 10_000)
        assert queue.num_never_taken == 10_000 - len(taken)
    assert compacted and len(taken) == 10_000


def test_builtin_names_are_the_chain_of_builtin_block_hash() -> None:
    """The pool inlines the builtin hash in its loop; the names must stay the function's."""
    kv = KVCacheManager(num_blocks=8, block_size=BLOCK, hash_algo="builtin")
    request = make_request("a", list(range(3, 3 + 4 * BLOCK + 2)))
    parent, expected = None, []
    for start in range(0, 4 * BLOCK, BLOCK):
        parent = builtin_block_hash(parent, request.all_token_ids[start : start + BLOCK])
        expected.append(parent)
    assert kv._hashes_for(request) == expected
