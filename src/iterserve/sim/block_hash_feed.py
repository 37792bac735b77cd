"""The block hash chains of a simulated workload, computed ahead on the other core.

A simulated request's every token is known before it arrives: its prompt, then the
executor's placeholder until max_tokens (sim/executor.py samples nothing else). So
the names its KV blocks will bear (core/kv_cache.py) are known too, and hashing them need
not take the one core that runs the fleet (benchmarks/fleet_replay.py --alternate times a
replay with and without the feed). A forked process
hashes the requests in arrival order and streams the chains back as int64; the fleet
hands each to its request (Request.block_hashes), and the pool finds nothing left to hash.
The pool's own function computes them, so the names, and every decision, are the same
(tests/sim/test_fleet.py runs a fleet both ways). The router's reading of each prompt
(Router.prepare: prefix-affinity's rendezvous hashing, as pure) comes along, and whether
a later request's first block bears the same name as the request's: until one does, the
replay's pool need not map its names (sim/replay_pool.py).

Only for Python's builtin hash (an int64; sha256 names do not pack so), with prefix
caching on, more than one core to run on, and enough requests to be worth a process.
"""

from __future__ import annotations

import multiprocessing
import os
from array import array
from collections.abc import Callable, Sequence
from multiprocessing.connection import Connection
from typing import NamedTuple

from iterserve.bench.workloads import WorkloadRequest
from iterserve.config import CacheConfig
from iterserve.core.kv_cache import block_hash_chain

# Requests a message carries, and the fewest for which a feed is worth its process.
_CHUNK = 1000
MIN_REQUESTS = 20_000


class FedRequest(NamedTuple):
    chain: list[int]  # its blocks' names (Request.block_hashes)
    prepared: object  # the router's reading of its prompt
    later_members: bool  # a later request's first block bears its first block's name


class BlockHashFeed:
    """What each request brings (FedRequest), in the order given, one `next()` an
    arrival."""

    def __init__(
        self,
        requests: Sequence[WorkloadRequest],
        order: Sequence[int],
        block_size: int,
        token_id: int,
        prepare: Callable[[list[int]], object] = lambda prompt: None,
    ) -> None:
        # Forked, not spawned: the child shares the workload without a copy, and
        # hash(None), which starts every chain, is the address of None in this process.
        context = multiprocessing.get_context("fork")
        self._conn, child_end = context.Pipe(duplex=False)
        self._process = context.Process(
            target=_produce,
            args=(child_end, requests, order, block_size, token_id, prepare),
            name="iterserve-block-hashes",
            daemon=True,
        )
        self._process.start()
        child_end.close()
        self._lengths: list[int] = []
        self._later: list[int] = []
        self._prepared: list[object] = []
        self._flat = memoryview(b"").cast("q")
        self._turn = 0  # index in _lengths of the next request
        self._at = 0  # its chain's offset in _flat

    @staticmethod
    def wanted(cache: CacheConfig, num_requests: int) -> bool:
        return (
            cache.enable_prefix_caching
            and cache.prefix_caching_hash_algo == "builtin"
            and num_requests >= MIN_REQUESTS
            and hasattr(os, "sched_getaffinity")  # Linux, where fork is safe to use
            and len(os.sched_getaffinity(0)) > 1
        )

    def next(self) -> FedRequest:
        if self._turn == len(self._lengths):
            self._receive()
        turn = self._turn
        n = self._lengths[turn]
        chain = self._flat[self._at : self._at + n].tolist()
        self._turn += 1
        self._at += n
        return FedRequest(chain, self._prepared[turn], bool(self._later[turn]))

    def close(self) -> None:
        self._conn.close()  # a producer still sending meets a closed pipe and ends
        self._process.join(timeout=5)
        if self._process.is_alive():
            self._process.terminate()

    def _receive(self) -> None:
        try:
            message = memoryview(self._conn.recv_bytes()).cast("q")
            prepared = self._conn.recv()
        except (EOFError, OSError):  # nothing more, or a message cut short
            self._process.join(timeout=5)
            raise RuntimeError(
                f"the block hash process ended early (exit code {self._process.exitcode})"
            ) from None
        count = message[0]
        self._lengths = message[1 : 1 + count].tolist()
        self._later = message[1 + count : 1 + 2 * count].tolist()
        self._flat = message[1 + 2 * count :]
        self._prepared = prepared
        self._turn = self._at = 0


def _produce(
    conn: Connection,
    requests: Sequence[WorkloadRequest],
    order: Sequence[int],
    block_size: int,
    token_id: int,
    prepare: Callable[[list[int]], object],
) -> None:
    """The chains of `requests` in `order`, _CHUNK to a message: [count, lengths,
    later-members flags, hashes]; then their prepare() answers, pickled."""
    try:
        later = _later_members(requests, order, block_size, token_id)
        for first in range(0, len(order), _CHUNK):
            lengths = array("q")
            flags = array("q", list(later[first : first + _CHUNK]))
            flat = array("q")
            prepared = []
            for i in order[first : first + _CHUNK]:
                request = requests[i]
                prompt = request.token_ids()
                tokens = prompt + [token_id] * request.output_len
                chain = block_hash_chain(tokens, block_size, "builtin")
                lengths.append(len(chain))
                flat.extend(chain)
                prepared.append(prepare(prompt))
            conn.send_bytes(
                array("q", [len(lengths)]).tobytes()
                + lengths.tobytes()
                + flags.tobytes()
                + flat.tobytes()
            )
            conn.send(prepared)
    except (BrokenPipeError, OSError):
        pass  # the fleet stopped early and closed its end
    finally:
        conn.close()


def _later_members(
    requests: Sequence[WorkloadRequest], order: Sequence[int], block_size: int, token_id: int
) -> bytes:
    """For each request in `order`, whether a later one's first block bears the same name
    (a name covers every token before it: requests that differ there share no block)."""
    later = bytearray(len(order))
    seen: set[int] = set()
    for turn in range(len(order) - 1, -1, -1):
        request = requests[order[turn]]
        head = request.head(block_size)
        head += [token_id] * min(request.output_len, block_size - len(head))
        for name in block_hash_chain(head, block_size, "builtin"):  # none if too short
            later[turn] = name in seen
            seen.add(name)
    return bytes(later)
