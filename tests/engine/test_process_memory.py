"""A process's memory (engine/process_memory.py) and how engine snapshots carry it: read in
the engine's own process, summed over a fleet, gone with a dead replica."""

from __future__ import annotations

import subprocess
import sys

from iterserve.engine.metrics import (
    EngineSnapshot,
    idle_snapshot,
    merge_snapshots,
    with_process_memory,
)
from iterserve.engine.process_memory import process_memory

_MIB = 1 << 20

# Touches 256 MiB, frees it, then waits: resident falls back, the peak stays.
_CHILD = """
import sys
block = bytearray(256 << 20)
for i in range(0, len(block), 4096):
    block[i] = 1
del block
print("ready", flush=True)
sys.stdin.readline()
"""


def test_another_process_peak_outlives_what_it_freed() -> None:
    child = subprocess.Popen(
        [sys.executable, "-c", _CHILD], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    try:
        assert child.stdout is not None and child.stdout.readline() == "ready\n"
        memory = process_memory(child.pid)
        assert memory is not None
        assert memory.peak >= 256 * _MIB
        assert memory.resident < memory.peak - 200 * _MIB
    finally:
        child.communicate("\n")
    assert process_memory(child.pid) is None  # reaped: no such process


def test_a_snapshot_takes_this_processs_memory_when_asked() -> None:
    bare = EngineSnapshot(weights_bytes=5, kv_cache_bytes=7)
    assert bare.resident_bytes == bare.peak_resident_bytes == 0
    before = process_memory()
    snap = with_process_memory(bare)
    after = process_memory()
    assert before is not None and after is not None
    assert before.resident * 0.9 <= snap.resident_bytes <= after.resident * 1.1
    assert before.peak <= snap.peak_resident_bytes <= after.peak
    assert (snap.weights_bytes, snap.kv_cache_bytes) == (5, 7)


def test_a_fleet_sums_its_replicas_memory_and_a_dead_one_holds_none() -> None:
    a = EngineSnapshot(weights_bytes=1, kv_cache_bytes=2, resident_bytes=30, peak_resident_bytes=40)
    b = EngineSnapshot(weights_bytes=1, kv_cache_bytes=2, resident_bytes=5, peak_resident_bytes=6)
    fleet = merge_snapshots([a, b])
    assert (fleet.weights_bytes, fleet.kv_cache_bytes) == (2, 4)
    assert (fleet.resident_bytes, fleet.peak_resident_bytes) == (35, 46)
    dead = idle_snapshot(a)
    assert (dead.weights_bytes, dead.kv_cache_bytes) == (0, 0)
    assert (dead.resident_bytes, dead.peak_resident_bytes) == (0, 0)
