"""The block pool of a simulated replica: the core pool (core/kv_cache.py), which also
leaves out of its prefix-cache map the names no lookup will ask for.

One dict insertion a block, into maps that on 64 pools do not fit in cache, was the
largest single cost of the million-request replay (docs/simulator.md), and nearly all of
it for nothing: a block's name covers every token before it, so only requests whose
first block bears the same name (a *group*) can ever ask for it, and in a replay they
mostly come minutes apart, long after the pool reused the blocks. A replay knows every
request's chain in advance (sim/block_hash_feed.py), and with it whether a later
request of its group will come. So a request that is alone in its group on this pool
names its blocks as the core pool does (the name decides where a freed block goes in
the free queue, and its eviction), but leaves the names out of the map, noting them only
if a later member will come. The map catches up when it could be asked:

- a member arrives while another is live, or while a noted name is still on a block:
  the noted names go in, and the group's names go through the map on this pool for good;
- a member is preempted: it will look up its own blocks; its names go in, likewise.

So whenever a request looks up a name, or names a block whose twin may exist, the map
holds every block bearing a name of its group, as the core pool's would: the same
hits, the same duplicates left unnamed, the same evictions. tests/sim/test_fleet.py
replays fleets with and without the feed, which is what tells the pool of groups.
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
        # Requests whose names may stay out of the map: their group, and whether a later
        # request of it will come.
        self._grouped: dict[str, tuple[BlockHash, bool]] = {}
        self._live: dict[BlockHash, int] = {}  # members admitted and not finished, by group
        self._noted: dict[BlockHash, list[tuple[int, BlockHash]]] = {}  # unmapped names
        self._mapped_groups: set[BlockHash] = set()  # named through the map here for good

    def admit_to_group(self, request: Request, later_members: bool) -> None:
        """Let the request's names stay out of the map while it is alone in its group (its
        first block's name) on this pool; `later_members`: whether a later request of the
        group will come. Call before it is first scheduled, its chain filled in."""
        if not request.block_hashes:
            return  # not one full block: it names none
        group = request.block_hashes[0]
        live = self._live.get(group, 0)
        if group not in self._mapped_groups:
            # A live member may name a block this one computes too. A noted name still
            # on its block is one this request may find; it could not compute a twin of
            # one as long as the pool frees a chain's tail first (core/kv_cache.py
            # free()), but mapping the group then keeps this pool exact whatever order
            # the core pool frees in.
            still_named = self._map_noted(group)
            if still_named or live:
                self._mapped_groups.add(group)
        self._live[group] = live + 1
        self._grouped[request.request_id] = (group, later_members)

    def free(self, request: Request) -> None:
        grouped = self._grouped.get(request.request_id)
        if grouped is not None:
            group = grouped[0]
            if request.status is RequestStatus.PREEMPTED:  # it will look its blocks up
                self._map_group(group)
                self._map_own_names(request)
            else:
                del self._grouped[request.request_id]
                live = self._live[group] - 1
                if live:
                    self._live[group] = live
                else:
                    del self._live[group]
        super().free(request)

    def _name_blocks(self, request: Request, block_ids: list[int], hashes: list[BlockHash]) -> None:
        grouped = self._grouped.get(request.request_id)
        if grouped is None or grouped[0] in self._mapped_groups:
            super()._name_blocks(request, block_ids, hashes)
            return
        # The core pool's loop without the map: alone in its group, the request meets no
        # block bearing one of its names but its own.
        names = self._names
        named = 0
        for block_id, block_hash in zip(block_ids, hashes, strict=True):
            if names[block_id] is None:
                names[block_id] = block_hash
                named += 1
        self._num_named += named
        group, later_members = grouped
        if later_members:
            self._noted.setdefault(group, []).extend(zip(block_ids, hashes, strict=True))

    def _map_group(self, group: BlockHash) -> None:
        """From now on the group's names go through the map on this pool."""
        self._map_noted(group)
        self._mapped_groups.add(group)

    def _map_noted(self, group: BlockHash) -> bool:
        """Map the group's noted names still on their blocks; whether any was."""
        names, cached = self._names, self._cached
        still_named = False
        for block_id, name in self._noted.pop(group, ()):
            if names[block_id] == name:
                cached[name] = block_id
                still_named = True
        return still_named

    def _map_own_names(self, request: Request) -> None:
        names, cached = self._names, self._cached
        for block_id in request.block_ids:
            name = names[block_id]
            if name is not None:  # named by this request, alone in its group
                cached[name] = block_id

    def _map_problem(self, block_id: int, name: BlockHash) -> str | None:
        # A name may be missing from the map, or its entry stale, while its group is not
        # asked for it; a live entry pointing elsewhere would find the wrong block.
        mapped = self._cached.get(name)
        if mapped is None or self._names[mapped] != name:
            return None
        return super()._map_problem(block_id, name)
