"""The block pool of a simulated replica: the core pool (core/kv_cache.py), which also
leaves out of its prefix-cache map the names no lookup can ask for.

A fleet replay knows every request's tokens in advance (sim/block_hash_feed.py), so it
knows which requests share no block with any other: those whose first block's name is
theirs alone (a name covers everything before it). No other request can ever look up
such a request's blocks, and the request itself looks them up only after a preemption.
Until then, the pool names its blocks as it names any others (the name decides where a
freed block goes in the free queue, and eviction counts it), but does not put the names
in the map: that one dict insertion a block, on 64 pools that do not fit in cache, was
the largest single cost of the million-request replay (docs/simulator.md). A preempted
request's names go into the map then, and it is named like any other from there on.

Every lookup, hit and eviction is the core pool's: tests/sim/test_fleet.py replays
fleets with and without the feed, which is what marks requests unshared.
"""

from __future__ import annotations

from iterserve.core.kv_cache import BlockHash, KVCacheManager
from iterserve.core.request import Request, RequestStatus


class ReplayBlockPool(KVCacheManager):
    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        enable_prefix_caching: bool = True,
        hash_algo: str = "sha256",
    ) -> None:
        super().__init__(num_blocks, block_size, enable_prefix_caching, hash_algo)
        self._unshared: set[str] = set()  # live requests whose names stay out of the map

    def keep_unshared(self, request_id: str) -> None:
        """No other request can name any block of this one: keep its names out of the
        map until it is preempted, or for good if it never is (call before it is first
        scheduled)."""
        self._unshared.add(request_id)

    def free(self, request: Request) -> None:
        if request.request_id in self._unshared:
            self._unshared.discard(request.request_id)
            if request.status is RequestStatus.PREEMPTED:  # it will look its blocks up
                self._map_names(request)
        super().free(request)

    def _map_names(self, request: Request) -> None:
        """Map the names of an unshared request's blocks, as the core pool would have."""
        names, cached = self._names, self._cached
        for block_id in request.block_ids:
            name = names[block_id]
            if name is not None:  # named by this request: no other block bears its names
                cached[name] = block_id

    def _name_blocks(self, request: Request, block_ids: list[int], hashes: list[BlockHash]) -> None:
        if request.request_id not in self._unshared:
            super()._name_blocks(request, block_ids, hashes)
            return
        # The core pool's loop without the map: a block is named twice only through
        # a hit, and an unshared request has none.
        names = self._names
        named = 0
        for block_id, block_hash in zip(block_ids, hashes, strict=True):
            if names[block_id] is None:
                names[block_id] = block_hash
                named += 1
        self._num_named += named

    def _map_problem(self, block_id: int, name: BlockHash) -> str | None:
        # An unshared name may be missing from the map, or its entry stale; only a live
        # entry pointing elsewhere would make a lookup find the wrong block.
        mapped = self._cached.get(name)
        if mapped is None or self._names[mapped] != name:
            return None
        return super()._map_problem(block_id, name)
