"""The Ray processes a test started, for the fleet tests: the cluster's daemons, which of
some pids still run, and the `cluster` fixture (a module-scoped Ray cluster), imported by
the fleet test modules. Not a conftest.py: a second one would shadow tests/conftest.py for
the `from conftest import ...` of other folders' tests."""

from __future__ import annotations

import os
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from server_fixtures import wait_until


def ray_daemons(parent: int) -> set[int]:
    """Pids of the Ray cluster processes (GCS, raylet) that `parent` started: ray.init
    starts them as its children. (Other users' Ray clusters on this machine are not ours
    to count.)"""
    out = subprocess.run(
        ["pgrep", "-P", str(parent), "-f", "raylet|gcs_server"],
        capture_output=True,
        text=True,
        check=False,
    )
    return {int(pid) for pid in out.stdout.split()}


def running(pids: set[int]) -> set[int]:
    """Those of `pids` still running (an exited child not yet reaped is a zombie: gone)."""
    alive = set()
    for pid in pids:
        try:
            state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except OSError:
            continue
        if state != "Z":
            alive.add(pid)
    return alive


@pytest.fixture(scope="module", name="cluster")
def module_cluster() -> Iterator[None]:
    ray = pytest.importorskip("ray")
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    ray.init(
        num_cpus=2,
        include_dashboard=False,
        object_store_memory=128 * 2**20,
        logging_level="warning",
        namespace="iterserve-test",
    )
    daemons = ray_daemons(os.getpid())
    try:
        yield
    finally:
        ray.shutdown()
        assert daemons and wait_until(lambda: not running(daemons), timeout=30), daemons
