"""The KV pools iterserve engines on this host have reserved, and how much of each they have
written: what --kv-cache-memory auto takes off the memory it measures
(engine/available_memory.py).

Why: a CPU pool is an anonymous mapping the kernel commits page by page as blocks are first
written, so an engine that has just started holds almost none of its pool, and MemAvailable
counts the rest as free. A second engine started then would take its share of memory the
first has already promised itself, and under load the two pools together could outgrow the
host. So each engine writes a line here (a small JSON file per pool, in
`$ITERSERVE_KV_POOLS_DIR`, else /dev/shm/iterserve-kv-pools, else the temp directory's),
keeps its written bytes in it as they grow, and removes it when it closes; an engine sizing
an auto pool takes off what the others have reserved and not yet written. A line whose
process is gone (killed, so it never removed it) is ignored and removed by the next reader;
one whose process id was reused is told apart by the process's start time.

Sizing a pool and writing its line happen under a lock on the directory (`sizing()`): engines
started together (data-parallel replicas on one host) would otherwise each measure before the
other's line is there, and both take their share of the same memory. So on one host pools are
sized in turn, each from what the ones before it left.

Except as equals: the replicas of one data-parallel launch on a local Ray cluster share the
host's memory evenly, told so by `$ITERSERVE_KV_POOL_GROUP` ("name:size", `PoolGroup`): each
takes its share divided by the group's size of what is available, not counting its siblings'
lines (an engine outside the group counts them all), and a member started again counts what
its siblings have written as the group's (`written_by_siblings`).

Only engines that share the directory see each other: processes in other containers (with
their own /dev/shm) are not counted, nor is anything but iterserve's pools.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import logging
import os
import tempfile
import weakref
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

try:
    import fcntl
except ImportError:  # not a POSIX system: pools are sized without the lock
    fcntl = None  # type: ignore[assignment]

logger = logging.getLogger("iterserve.engine")

DIRECTORY_ENV = "ITERSERVE_KV_POOLS_DIR"
GROUP_ENV = "ITERSERVE_KV_POOL_GROUP"

# A pool's line is rewritten once its written blocks have grown by this share of the pool
# since the last write: at most ~256 small writes in a pool's life, and a reader
# overcounting what is unwritten by at most 0.4% of it.
_RECORD_STEP = 1 / 256

# Tells apart the lines of one process's engines (a benchmark may build several).
_numbers = itertools.count(1)


def directory() -> Path:
    """Where the lines are: `$ITERSERVE_KV_POOLS_DIR`, else in /dev/shm (memory, gone at
    reboot, shared by the host's processes), else the temp directory."""
    if chosen := os.environ.get(DIRECTORY_ENV):
        return Path(chosen)
    shm = Path("/dev/shm")
    base = shm if shm.is_dir() and os.access(shm, os.W_OK) else Path(tempfile.gettempdir())
    return base / "iterserve-kv-pools"


@dataclass(frozen=True)
class PoolGroup:
    """Engines that share this host's memory as equals (a data-parallel launch's replicas on
    a local cluster): each takes 1/size of an auto pool's share."""

    name: str
    size: int

    @classmethod
    def from_env(cls) -> PoolGroup | None:
        name, _, size = os.environ.get(GROUP_ENV, "").rpartition(":")
        return cls(name, int(size)) if name and size.isdigit() and int(size) > 0 else None

    def env(self) -> dict[str, str]:
        """The environment that puts a process in the group."""
        return {GROUP_ENV: f"{self.name}:{self.size}"}


@dataclass(frozen=True)
class PoolLine:
    """One engine's pool as its line says it."""

    pid: int
    model: str
    reserved_bytes: int
    written_bytes: int
    group: str | None = None

    @property
    def unwritten_bytes(self) -> int:
        return max(0, self.reserved_bytes - self.written_bytes)


@dataclass(frozen=True)
class Unwritten:
    """What other engines' pools have reserved and not written, summed."""

    bytes: int
    pools: int

    def describe(self) -> str:
        pools = "pool" if self.pools == 1 else "pools"
        return (
            f"less {self.bytes / 2**30:.2f} GiB reserved and not yet written by "
            f"{self.pools} other iterserve KV {pools}"
        )


class PoolRecord:
    """This engine's line: made with the pool, its written part kept as it grows, removed by
    `close()` (or when the record is collected, or at exit). If the directory cannot be
    written, the engine runs without a line (logged): others will not count its pool."""

    def __init__(
        self, model: str, reserved_bytes: int, num_blocks: int, where: Path | None = None
    ) -> None:
        where = where or directory()
        self.path: Path | None = where / f"{os.getpid()}.{next(_numbers)}.json"
        self._line = {
            "pid": os.getpid(),
            "start_time": _start_time(os.getpid()),
            "model": model,
            "reserved_bytes": reserved_bytes,
            "written_bytes": 0,
            "group": group.name if (group := PoolGroup.from_env()) else None,
        }
        self._reserved, self._num_blocks = reserved_bytes, max(1, num_blocks)
        self._step = max(1, int(num_blocks * _RECORD_STEP))
        self._recorded = 0
        try:
            _make_shared_directory(where)
            self._write()
        except OSError as error:
            logger.warning(
                "KV pool not recorded in %s (%s): engines started later on this host will "
                "count its unwritten part as free memory",
                where,
                error,
            )
            self.path = None
            return
        self._finalizer = weakref.finalize(self, _remove, self.path)

    def record(self, written_blocks: int) -> None:
        """The pool's blocks written at least once, after every step: the line is rewritten
        only when they have grown by a step."""
        if self.path is None or written_blocks - self._recorded < self._step:
            return
        # As /metrics' iterserve:kv_cache_written_bytes counts them.
        self._line["written_bytes"] = self._reserved * written_blocks // self._num_blocks
        self._recorded = written_blocks
        try:
            self._write()
        except OSError:  # the directory went away: nothing left to keep up to date
            self.close()

    def close(self) -> None:
        if self.path is not None:
            self._finalizer()
            self.path = None

    def _write(self) -> None:
        assert self.path is not None
        partial = self.path.with_suffix(".part")
        partial.write_text(json.dumps(self._line))
        os.replace(partial, self.path)  # a reader sees the old line or the new, whole


class PoolLines:
    """An engine's pools' lines (its own and a draft model's), each kept up to date from its
    block pool's count of blocks written, read when `record()` is called after a step."""

    def __init__(self) -> None:
        self._lines: list[tuple[PoolRecord, Callable[[], int]]] = []

    def add(
        self, model: str, reserved_bytes: int, num_blocks: int, written: Callable[[], int]
    ) -> None:
        self._lines.append((PoolRecord(model, reserved_bytes, num_blocks), written))

    def record(self) -> None:
        for line, written in self._lines:
            line.record(written())

    def close(self) -> None:
        for line, _ in self._lines:
            line.close()


@contextlib.contextmanager
def sizing(where: Path | None = None) -> Iterator[None]:
    """The directory held against other engines while this one measures, sizes its pool and
    writes its line. Without a lock to take (a directory this user cannot use, no fcntl) it
    goes on unlocked."""
    where = where or directory()
    lock: int | None = None
    with contextlib.suppress(OSError):
        _make_shared_directory(where)
        lock = os.open(where / ".lock", os.O_RDONLY | os.O_CREAT, 0o666)
    try:
        if lock is not None and fcntl is not None:
            fcntl.flock(lock, fcntl.LOCK_EX)  # released when the descriptor closes
        yield
    finally:
        if lock is not None:
            os.close(lock)


def unwritten_elsewhere(where: Path | None = None) -> Unwritten:
    """What the pools of other live engines (outside this process's group) have reserved and
    not yet written; lines of processes that are gone are removed."""
    total, pools = 0, 0
    group = PoolGroup.from_env()
    for line in live_lines(where or directory()):
        if group is not None and line.group == group.name:
            continue  # a sibling: the group's share is divided among them instead
        total += line.unwritten_bytes
        pools += 1
    return Unwritten(total, pools)


def written_by_siblings(where: Path | None = None) -> int:
    """Bytes the pools of this process's group have written (0 outside a group): memory the
    group's share already holds, so a member that starts again (a replica restarted) sizes
    its pool from the share as the first members did, not from what is left of it."""
    group = PoolGroup.from_env()
    if group is None:
        return 0
    lines = live_lines(where or directory())
    return sum(line.written_bytes for line in lines if line.group == group.name)


def live_lines(where: Path) -> list[PoolLine]:
    """The lines of engines still running (this process's other engines among them)."""
    lines = []
    for path in sorted(where.glob("*.json")) if where.is_dir() else []:
        try:
            line = json.loads(path.read_text())
            pid, start = int(line["pid"]), line["start_time"]
            pool = PoolLine(
                pid,
                str(line["model"]),
                int(line["reserved_bytes"]),
                int(line["written_bytes"]),
                line.get("group"),
            )
        except (OSError, ValueError, KeyError, TypeError):
            continue  # removed while read, or not a line of ours
        if not _alive(pid, start):
            _remove(path)
            continue
        lines.append(pool)
    return lines


def _alive(pid: int, start_time: int | None) -> bool:
    """Whether the process that wrote a line still runs: the id is taken and, where /proc
    says when processes started, by a process that started when the writer did."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass  # another user's process: it exists
    return start_time is None or _start_time(pid) in (None, start_time)


def _start_time(pid: int) -> int | None:
    """When the process started, in clock ticks after boot (/proc/PID/stat's 22nd field);
    None where there is no /proc."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    # The command name (2nd field) is in parentheses and may hold spaces: count after it.
    return int(stat.rsplit(")", 1)[1].split()[19])


def _make_shared_directory(where: Path) -> None:
    """The directory, writable by every user (sticky, as /tmp: each removes only its own),
    so engines of different users see each other."""
    if where.is_dir():
        return
    where.mkdir(parents=True, exist_ok=True)
    with contextlib.suppress(OSError):  # made by another user just now, or no modes here
        where.chmod(0o1777)


def _remove(path: Path) -> None:
    with contextlib.suppress(OSError):  # gone already, or another user's (sticky directory)
        path.unlink()
