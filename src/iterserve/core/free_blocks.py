"""The KV block pool's free queue: which free block is reused next.

Blocks that hold a named (prefix-cached) block wait at the back, least recently freed
first, so a shared prefix survives as long as it can; blocks with nothing worth keeping
are reused before any of them, most recently freed first. A prefix hit takes a named
block out of the middle.

An OrderedDict does all of that, but its pop from the front and insert at the back were
the two hottest lines of a large simulation (a million requests take and free ~1e8
blocks, and each OrderedDict operation touches a hash table and a linked node). Here the
back is a list read from a moving head, the front a stack, and a block taken out of the
middle leaves its entry behind, stale, to be skipped when the head reaches it: each free
block knows the position of its one live entry.
"""

from __future__ import annotations

from collections.abc import Iterator

_HELD = -1  # the block is not free
_FRONT = -2  # the block is in the front stack
# The back list drops its consumed head once the head is past this and past half the list.
_COMPACT_AFTER = 4096


class FreeBlockQueue:
    def __init__(self, num_blocks: int) -> None:
        """All `num_blocks` blocks free, to be reused in id order."""
        self._front: list[int] = []  # its last element is reused first
        self._back = list(range(num_blocks))
        self._head = 0  # index in _back of the next entry to read
        self._base = 0  # position of _back[0]; positions count every entry ever queued
        # Per block: the position of its live entry in _back, or _FRONT, or _HELD.
        self._pos = list(range(num_blocks))
        self._size = num_blocks

    def __len__(self) -> int:
        return self._size

    def __contains__(self, block_id: int) -> bool:
        return self._pos[block_id] != _HELD

    def __iter__(self) -> Iterator[int]:
        """The free blocks in the order they would be reused."""
        yield from reversed(self._front)
        pos, first = self._pos, self._base + self._head
        for offset, block_id in enumerate(self._back[self._head :]):
            if pos[block_id] == first + offset:
                yield block_id

    def take(self, count: int) -> list[int]:
        """The next `count` blocks to reuse, no longer free (the caller checked there are)."""
        if count > self._size:
            raise ValueError(f"{count} blocks wanted, {self._size} free")
        front, pos = self._front, self._pos
        split = max(0, len(front) - count)
        taken = front[split:][::-1]
        del front[split:]
        for block_id in taken:
            pos[block_id] = _HELD
        if len(taken) < count:
            back, head = self._back, self._head
            position = self._base + head
            while len(taken) < count:
                block_id = back[head]
                if pos[block_id] == position:  # else a stale entry: the block left early
                    pos[block_id] = _HELD
                    taken.append(block_id)
                head += 1
                position += 1
            if head > _COMPACT_AFTER and 2 * head > len(back):
                del back[:head]
                self._base += head
                head = 0
            self._head = head
        self._size -= count
        return taken

    def push_back(self, block_id: int) -> None:
        """Free a block worth keeping: reused after every block free now."""
        self._pos[block_id] = self._base + len(self._back)
        self._back.append(block_id)
        self._size += 1

    def push_front(self, block_id: int) -> None:
        """Free a block with nothing worth keeping: reused before every block free now."""
        self._pos[block_id] = _FRONT
        self._front.append(block_id)
        self._size += 1

    def remove(self, block_id: int) -> None:
        """Take one free block out of turn (a prefix hit on a block no request holds)."""
        where = self._pos[block_id]
        if where == _HELD:
            raise ValueError(f"block {block_id} is not free")
        if where == _FRONT:
            self._front.remove(block_id)
        self._pos[block_id] = _HELD  # an entry in _back stays, stale, until the head passes
        self._size -= 1
