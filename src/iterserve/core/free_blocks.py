"""The KV block pool's free queue: which free block is reused next.

Blocks that hold a named (prefix-cached) block wait at the back, least recently freed
first, so a shared prefix survives as long as it can; blocks with nothing worth keeping
are reused before any of them, most recently freed first. A prefix hit takes a named
block out of the middle.

An OrderedDict does all of that, but its pop from the front and insert at the back were
the two hottest lines of a large simulation (a million requests take and free ~1e8
blocks, and each OrderedDict operation touches a hash table and a linked node). Here the
back is a list read from a moving head, so taking blocks in turn is a slice and freeing
one an append, and the front is a stack. A block taken out of turn leaves its entry in
the back list behind, stale: the queue counts such entries per block, and skips one when
the head reaches it (a block's stale entries all come before its live one, if any).
"""

from __future__ import annotations

from collections.abc import Iterator

# The back list drops its consumed head once the head is past this and past half the list.
_COMPACT_AFTER = 4096


class FreeBlockQueue:
    def __init__(self, num_blocks: int) -> None:
        """All `num_blocks` blocks free, to be reused in id order."""
        self._front: list[int] = []  # its last element is reused first
        self._back = list(range(num_blocks))
        self._head = 0  # index in _back of the next entry to read
        # _back[:_fresh_end] are the blocks as first queued: those past the head were never
        # taken (nor named, so never taken out of turn).
        self._fresh_end = num_blocks
        self._stale: dict[int, int] = {}  # block -> its stale entries ahead of the head
        self._size = num_blocks

    def __len__(self) -> int:
        return self._size

    @property
    def num_never_taken(self) -> int:
        """Blocks not taken yet since the queue was made: the highest ids, as they are
        taken in id order."""
        return max(0, self._fresh_end - self._head)

    def __iter__(self) -> Iterator[int]:
        """The free blocks in the order they would be reused."""
        yield from reversed(self._front)
        stale = dict(self._stale)
        for block_id in self._back[self._head :]:
            if stale.get(block_id):
                stale[block_id] -= 1
            else:
                yield block_id

    def take(self, count: int) -> list[int]:
        """The next `count` blocks to reuse, no longer free (the caller checked there are)."""
        if count > self._size:
            raise ValueError(f"{count} blocks wanted, {self._size} free")
        front = self._front
        split = max(0, len(front) - count)
        taken = front[split:][::-1]
        del front[split:]
        if len(taken) < count:
            back, head, wanted = self._back, self._head, count - len(taken)
            run = back[head : head + wanted]
            stale = self._stale
            if not stale or stale.keys().isdisjoint(run):  # the usual case: all are live
                taken += run
                head += wanted
            else:
                head = self._take_skipping_stale(taken, count, head)
            if head > _COMPACT_AFTER and 2 * head > len(back):
                del back[:head]
                self._fresh_end = max(0, self._fresh_end - head)
                head = 0
            self._head = head
        self._size -= count
        return taken

    def push_back(self, block_ids: list[int]) -> None:
        """Free blocks worth keeping: reused after every block free now, in this order."""
        self._back += block_ids
        self._size += len(block_ids)

    def push_front(self, block_ids: list[int]) -> None:
        """Free blocks with nothing worth keeping, one after another: each is reused before
        every block free before it (so the last of them first)."""
        self._front += block_ids
        self._size += len(block_ids)

    def remove(self, block_id: int) -> None:
        """Take one free block out of turn (a prefix hit on a block no request holds); the
        caller knows it is free."""
        if block_id in self._front:  # never a named block, so never for a prefix hit
            self._front.remove(block_id)
        else:
            self._stale[block_id] = self._stale.get(block_id, 0) + 1
        self._size -= 1

    def _take_skipping_stale(self, taken: list[int], count: int, head: int) -> int:
        back, stale = self._back, self._stale
        while len(taken) < count:
            block_id = back[head]
            head += 1
            left = stale.get(block_id)
            if left is None:
                taken.append(block_id)
            elif left == 1:
                del stale[block_id]
            else:
                stale[block_id] = left - 1
        return head
