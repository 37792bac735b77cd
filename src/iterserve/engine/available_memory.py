"""How much memory this process could still take: what --kv-cache-memory auto takes its
share of (engine/kv_pool_size.py).

On Linux, the smaller of the kernel's MemAvailable (free memory plus the page cache and
slabs it can reclaim) and, for each cgroup the process sits in or under that has a memory
limit, that limit less the cgroup's usage: a container sees the host's MemAvailable but is
killed at its own limit. Usage leaves out the cgroup's inactive file cache, which the kernel
reclaims before it would kill (the kubelet's "working set" does the same); counting it would
leave a long-running container's page cache looking like used memory. Less, on a host, what
other iterserve engines' KV pools have reserved and not yet written (engine/kv_pool_ledger.py):
a pool is committed as it is written, so MemAvailable counts its unwritten part as free. On
CUDA, the device's free memory. `measure()` is the one function the engine sizes its pool by,
so tests replace it (the weights' check before a load, engine/weights_fit.py, reads
`host_room()`).
"""

from __future__ import annotations

import math
import os
from collections.abc import Mapping
from pathlib import Path

import torch

from iterserve.engine import kv_pool_ledger
from iterserve.engine.kv_pool_size import AvailableMemory
from iterserve.model.lazy_weights import shape_of

# cgroup v1 writes "no limit" as a huge number (2**63 rounded down to a page); anything this
# large is no limit on any machine.
_NO_LIMIT = 2**60


def measure(device: torch.device) -> AvailableMemory:
    """Memory available to this process on `device` now."""
    if device.type == "cuda":
        free, _total = torch.cuda.mem_get_info(device)
        return AvailableMemory(free, f"free memory of {device}")
    room = host_room()
    if (written := kv_pool_ledger.written_by_siblings()) > 0:  # one of a group of equals
        room = AvailableMemory(
            room.bytes + written,
            f"{room.source}, plus {written / 2**30:.2f} GiB its group's other pools have "
            "written (the group's share)",
            room.reserved_elsewhere,
        )
    return room


def host_room() -> AvailableMemory:
    """The host's available memory as this process's cgroups allow it, less what other
    engines' KV pools have reserved and not yet written."""
    return less_other_pools(host_available(), kv_pool_ledger.unwritten_elsewhere())


def less_other_pools(reading: AvailableMemory, others: kv_pool_ledger.Unwritten) -> AvailableMemory:
    """`reading` less what other engines' pools have promised themselves and not yet taken."""
    if others.pools == 0:
        return reading
    return AvailableMemory(
        max(0, reading.bytes - others.bytes),
        f"{reading.source} {others.describe()}",
        reserved_elsewhere=others.bytes,
    )


def estimate_after_weights(
    device: torch.device, weights: Mapping[str, torch.Tensor], dtype: torch.dtype, ranks: int
) -> AvailableMemory:
    """What will be left once `ranks` tensor-parallel shards of `weights` are built, guessed
    before they are: the workers allocate their shares of the pool as they start, so the
    pool must be sized first. The checkpoint's bytes in `dtype` (read off the shapes: the
    loaders make tensors only when read) come off what is available now; on CUDA each rank
    has a GPU of its own, taken to have as much free as this one."""
    now = measure(device)
    weight_bytes = sum(math.prod(shape_of(weights, name)) for name in weights) * dtype.itemsize
    free = now.bytes * (ranks if device.type == "cuda" else 1)
    return AvailableMemory(
        max(0, free - weight_bytes),
        f"estimate: {now.source} less the checkpoint's {weight_bytes / 2**30:.2f} GiB",
        reserved_elsewhere=now.reserved_elsewhere,
    )


def host_available(root: Path = Path("/")) -> AvailableMemory:
    """The host's available memory as this process's cgroups allow it; `root` is where /proc
    and /sys are (a fake tree in tests)."""
    best = _mem_available(root)
    for headroom in _cgroup_headrooms(root):
        if headroom.bytes < best.bytes:
            best = headroom
    return best


def meminfo_bytes(key: str, root: Path = Path("/")) -> int | None:
    """/proc/meminfo's `key` ("MemAvailable", "SwapFree", ...) in bytes; None where it is
    not there (not Linux, an old kernel)."""
    meminfo = root / "proc" / "meminfo"
    if meminfo.exists():
        for line in meminfo.read_text().splitlines():
            if line.startswith(f"{key}:"):
                return int(line.split()[1]) * 1024
    return None


def _mem_available(root: Path) -> AvailableMemory:
    if (available := meminfo_bytes("MemAvailable", root)) is not None:
        return AvailableMemory(available, "MemAvailable")
    # Not Linux (or a kernel before 3.14): the machine's memory is the best bound we have.
    physical = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    return AvailableMemory(physical, "physical memory")


def _cgroup_headrooms(root: Path) -> list[AvailableMemory]:
    """Limit less usage of each limited cgroup from the process's own up to the hierarchy's
    root (a parent's limit binds its children too). Directories that are not there are
    skipped: in a container without its own cgroup namespace, /proc/self/cgroup names the
    host's path while /sys/fs/cgroup is the container's own cgroup."""
    membership = root / "proc" / "self" / "cgroup"
    if not membership.exists():
        return []
    out = []
    for line in membership.read_text().splitlines():
        hierarchy, controllers, path = line.split(":", 2)
        if hierarchy == "0" and controllers == "":  # cgroup v2, the unified hierarchy
            mount, files = root / "sys" / "fs" / "cgroup", _V2_FILES
        elif "memory" in controllers.split(","):  # cgroup v1's memory controller
            mount, files = root / "sys" / "fs" / "cgroup" / "memory", _V1_FILES
        else:
            continue
        parts = [p for p in path.split("/") if p]
        for depth in range(len(parts), -1, -1):
            headroom = _headroom(mount.joinpath(*parts[:depth]), files)
            if headroom is not None:
                out.append(headroom)
    return out


# (limit, usage, the memory.stat key of the inactive file cache) for each cgroup version.
_V2_FILES = ("memory.max", "memory.current", "inactive_file")
_V1_FILES = ("memory.limit_in_bytes", "memory.usage_in_bytes", "total_inactive_file")


def _headroom(directory: Path, files: tuple[str, str, str]) -> AvailableMemory | None:
    limit_file, usage_file, inactive_key = files
    try:
        limit_text = (directory / limit_file).read_text().strip()
        usage = int((directory / usage_file).read_text())
    except (OSError, ValueError):
        return None  # no such cgroup here, or no limit file (v2's root cgroup has none)
    if limit_text == "max" or int(limit_text) >= _NO_LIMIT:
        return None
    inactive = 0
    stat = directory / "memory.stat"
    if stat.exists():
        for line in stat.read_text().splitlines():
            key, _, value = line.partition(" ")
            if key == inactive_key:
                inactive = int(value)
    used = max(0, usage - inactive)
    limit = int(limit_text)
    return AvailableMemory(max(0, limit - used), f"cgroup {directory}: {limit_file} less its usage")
