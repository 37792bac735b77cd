"""Joining or starting the Ray cluster that data-parallel replicas run on, and how many
cores each replica's torch may use.

Ray is imported here and only here on the way in, and only when a front end needs it,
so a single-engine server and `import iterserve` never load it.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass

logger = logging.getLogger("iterserve.data_parallel")

# Ray's object store holds nothing big here (token ids, text deltas): a small one keeps a
# local cluster from reserving a third of the machine's memory in /dev/shm.
_OBJECT_STORE_BYTES = 128 * 2**20


@dataclass(frozen=True)
class RayCluster:
    address: str  # what ray.init was given, or how we came by it
    connected_here: bool  # this front end called ray.init, so it calls ray.shutdown
    started_here: bool  # ... which for a cluster it started also stops the cluster


def local_cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def threads_per_replica(num_replicas: int, num_threads: int | None) -> int:
    """--num-threads if given, else this machine's cores shared out, so N replicas on one
    machine do not oversubscribe it (each torch would otherwise take every core, and N
    OpenMP pools spinning on the same cores slow all of them down)."""
    return num_threads or max(1, local_cores() // num_replicas)


def connect(address: str | None, num_cpus: int) -> RayCluster:
    """Use the Ray this process already joined, else join `address` ("auto": $RAY_ADDRESS
    or the cluster this machine started last; an IP:port; "ray://..."), else ("local" or
    None) start a fresh local cluster of `num_cpus` CPUs. Ray must not phone home: usage
    stats are off, and there is no dashboard."""
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    import ray

    if ray.is_initialized():
        return RayCluster("joined before", connected_here=False, started_here=False)
    options: dict[str, object] = {
        "include_dashboard": False,
        "logging_level": logging.WARNING,
        "namespace": "iterserve",
    }
    if address is not None and address != "local":
        ray.init(address=address, **options)
        logger.info("joined the Ray cluster at %s", address)
        return RayCluster(address, connected_here=True, started_here=False)
    # "local", not None: ray.init(None) would join whatever cluster this machine ran last
    # (another server's, say) rather than start this server's own.
    ray.init(address="local", num_cpus=num_cpus, object_store_memory=_OBJECT_STORE_BYTES, **options)
    logger.info("started a local Ray cluster (%d CPUs)", num_cpus)
    return RayCluster("started here", connected_here=True, started_here=True)


def disconnect(cluster: RayCluster) -> None:
    """Leave the cluster if we joined it, which stops it if we started it (a cluster we
    joined keeps running for its other users; one joined before us is left as it is)."""
    import ray

    if cluster.connected_here and ray.is_initialized():
        ray.shutdown()
