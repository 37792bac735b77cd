"""A Ray cluster per test module of the data-parallel fleet (2 CPUs, no dashboard), gone
with its daemons when the module is done."""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest
from ray_processes import ray_daemons, running

from server_fixtures import wait_until


@pytest.fixture(scope="module")
def cluster() -> Iterator[None]:
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
