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
the free queue, and its eviction), but leaves the names out of the map; if a later
member will come, it leaves a note of its blocks when it finishes. The map catches up
when it could be asked:

- a member arrives while another is live, or while the note's first block still bears
  its name: the names left go in, and the group's names go through the map on this
  pool for good;
- a member is preempted: it will look up its own blocks; likewise.

So whenever a request looks up a name, or names a block whose twin may exist, the map
holds every block bearing a name of its group, as the core pool's would: the same
hits, the same duplicates left unnamed, the same evictions. tests/sim/test_fleet.py
replays fleets with and without the feed, which is what tells the pool of groups.
"""

from __future__ import annotations

from array import array
from typing import Any

from iterserve.core.kv_cache import BlockHash, KVCacheManager
from iterserve.core.request import Request, RequestStatus


class ReplayBlockPool(KVCacheManager):
    def __init__(self, *args: Any, **kwargs: Any) -> None:  # KVCacheManager's
        super().__init__(*args, **kwargs)
        # Requests whose names may stay out of the map: their group, and whether a later
        # request of it will come.
        self._grouped: dict[str, tuple[BlockHash, bool]] = {}
        self._members: dict[BlockHash, list[Request]] = {}  # admitted, not finished
        # The blocks a finished member named, while a later one may come to look them up.
        self._noted: dict[BlockHash, array[int]] = {}
        self._mapped_groups: set[BlockHash] = set()  # named through the map here for good

    def admit_to_group(self, request: Request, later_members: bool) -> None:
        """Let the request's names stay out of the map while it is alone in its group (its
        first block's name) on this pool; `later_members`: whether a later request of the
        group will come. Call before it is first scheduled, its chain filled in."""
        if not request.block_hashes:
            return  # not one full block: it names none
        group = request.block_hashes[0]
        members = self._members.setdefault(group, [])
        # A live member may name a block this one computes too, and the blocks of the
        # last one may still be there to find: then the group goes through the map.
        if group not in self._mapped_groups and (self._map_noted(group) or members):
            self._map_group(group)
        members.append(request)
        self._grouped[request.request_id] = (group, later_members)

    def free(self, request: Request) -> None:
        grouped = self._grouped.get(request.request_id)
        if grouped is not None:
            group, later_members = grouped
            alone = group not in self._mapped_groups
            if request.status is RequestStatus.PREEMPTED:  # it will look its blocks up
                if alone:
                    self._map_group(group)
            else:
                self._leave_group(request, group, note=alone and later_members)
                if alone:
                    self._free_alone(request)
                    return
        super().free(request)

    def _free_alone(self, request: Request) -> None:
        """The core pool's free() for a request alone in its group all its life: it took
        every block fresh (no hit: nothing of its group was left to find) and holds it
        alone, and the blocks it named are its first ones."""
        block_ids = request.block_ids
        refs = self._refs
        for block_id in block_ids:
            refs[block_id] = 0
        named = self._named_upto.get(request.request_id, 0)
        keep, drop = block_ids[:named], block_ids[named:]
        keep.reverse()
        drop.reverse()
        self._queue_freed(request, keep, drop)

    def _leave_group(self, request: Request, group: BlockHash, note: bool) -> None:
        """A finished member leaves; `note`: it was alone, and a later member will come."""
        del self._grouped[request.request_id]
        members = self._members[group]
        members.remove(request)
        if not members:
            del self._members[group]
        if note:
            named = self._named_upto.get(request.request_id, 0)  # all named, alone
            if named:
                self._noted[group] = array("i", request.block_ids[:named])

    def _name_blocks(self, request: Request, block_ids: list[int], hashes: list[BlockHash]) -> None:
        grouped = self._grouped.get(request.request_id)
        if grouped is None or grouped[0] in self._mapped_groups:
            super()._name_blocks(request, block_ids, hashes)
            return
        # The core pool's loop without the map: alone in its group, the request took its
        # blocks fresh (their names evicted), and meets no block bearing one of its names.
        names = self._names
        for block_id, block_hash in zip(block_ids, hashes, strict=True):
            names[block_id] = block_hash
        self._num_named += len(block_ids)

    def _map_group(self, group: BlockHash) -> None:
        """From now on the group's names go through the map on this pool: map those on
        the live members' blocks and the noted ones."""
        self._map_noted(group)
        names, cached = self._names, self._cached
        for member in self._members.get(group, ()):
            for block_id in member.block_ids:
                name = names[block_id]
                if name is not None:
                    cached[name] = block_id
        self._mapped_groups.add(group)

    def _map_noted(self, group: BlockHash) -> bool:
        """Map the names left on the blocks the group's last finished member named;
        whether there are any. The pool frees a chain's tail first and evicts from the
        front of its queue, and nobody else touches a chain's blocks while its group has
        no member here: its names go tail first, and the first block's goes last."""
        noted = self._noted.pop(group, None)
        names = self._names
        if noted is None or names[noted[0]] != group:
            return False
        cached = self._cached
        for block_id in noted:
            name = names[block_id]
            if name is not None:  # its name, or one a later request gave the block
                cached[name] = block_id
        return True

    def _map_problem(self, block_id: int, name: BlockHash) -> str | None:
        # A name may be missing from the map, or its entry stale, while its group is not
        # asked for it; a live entry pointing elsewhere would find the wrong block.
        mapped = self._cached.get(name)
        if mapped is None or self._names[mapped] != name:
            return None
        return super()._map_problem(block_id, name)
