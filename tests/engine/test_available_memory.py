"""What --kv-cache-memory auto takes its share of: MemAvailable, or a cgroup's limit less its
usage where that is smaller, read from fake /proc and /sys trees; and, for tensor
parallelism, the estimate made before the shards exist."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from iterserve.engine import available_memory
from iterserve.engine.available_memory import estimate_after_weights, host_available
from iterserve.engine.kv_pool_size import AvailableMemory

GIB = 2**30


def fake_host(root: Path, mem_available: int, cgroup: str = "0::/\n") -> Path:
    (root / "proc" / "self").mkdir(parents=True)
    (root / "proc" / "meminfo").write_text(
        f"MemTotal:       99999999 kB\nMemFree:         1000000 kB\n"
        f"MemAvailable:   {mem_available // 1024} kB\nBuffers:           14012 kB\n"
    )
    (root / "proc" / "self" / "cgroup").write_text(cgroup)
    return root


def cgroup_v2(root: Path, path: str, limit: str, current: int, inactive_file: int = 0) -> Path:
    directory = root / "sys" / "fs" / "cgroup" / path.strip("/")
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "memory.max").write_text(limit + "\n")
    (directory / "memory.current").write_text(f"{current}\n")
    (directory / "memory.stat").write_text(
        f"anon 12345\nfile 67890\nactive_file 1\ninactive_file {inactive_file}\n"
    )
    return directory


def test_without_a_cgroup_limit_it_is_mem_available(tmp_path: Path) -> None:
    root = fake_host(tmp_path, 20 * GIB, "0::/user.slice/session.scope\n")
    cgroup_v2(root, "/user.slice/session.scope", "max", 3 * GIB)
    cgroup_v2(root, "/user.slice", "max", 5 * GIB)
    reading = host_available(root)
    assert reading.bytes == 20 * GIB and reading.source == "MemAvailable"


def test_a_cgroup_v2_limit_under_mem_available_binds(tmp_path: Path) -> None:
    root = fake_host(tmp_path, 20 * GIB, "0::/job\n")
    # 8 GiB limit, 3 GiB used of which 1 GiB is inactive file cache the kernel would reclaim.
    cgroup_v2(root, "/job", str(8 * GIB), 3 * GIB, inactive_file=1 * GIB)
    reading = host_available(root)
    assert reading.bytes == 8 * GIB - 2 * GIB
    assert "job" in reading.source and "memory.max" in reading.source


def test_a_parent_cgroup_s_limit_binds_its_children(tmp_path: Path) -> None:
    root = fake_host(tmp_path, 20 * GIB, "0::/pod/container\n")
    cgroup_v2(root, "/pod/container", "max", 1 * GIB)
    cgroup_v2(root, "/pod", str(4 * GIB), 3 * GIB)  # a sibling uses 2 of its 3 GiB
    assert host_available(root).bytes == 1 * GIB


def test_a_limit_over_mem_available_leaves_mem_available(tmp_path: Path) -> None:
    root = fake_host(tmp_path, 2 * GIB, "0::/job\n")
    cgroup_v2(root, "/job", str(64 * GIB), 1 * GIB)
    assert host_available(root).bytes == 2 * GIB


def test_inside_a_container_the_mount_is_its_own_cgroup(tmp_path: Path) -> None:
    # /proc/self/cgroup names the host's path, which this mount does not have; the limit is
    # on the mount's root (the container's cgroup).
    root = fake_host(tmp_path, 20 * GIB, "0::/system.slice/docker-abc.scope\n")
    cgroup_v2(root, "/", str(6 * GIB), 1 * GIB)
    assert host_available(root).bytes == 5 * GIB


def test_a_cgroup_v1_memory_limit_binds(tmp_path: Path) -> None:
    root = fake_host(
        tmp_path, 20 * GIB, "9:name=systemd:/\n4:memory:/process_api/abc\n3:cpuset:/\n0::/\n"
    )
    directory = root / "sys" / "fs" / "cgroup" / "memory" / "process_api" / "abc"
    directory.mkdir(parents=True)
    (directory / "memory.limit_in_bytes").write_text(f"{3 * GIB}\n")
    (directory / "memory.usage_in_bytes").write_text(f"{GIB}\n")
    (directory / "memory.stat").write_text(
        f"cache 5\ninactive_file 7\ntotal_inactive_file {GIB // 2}\n"
    )
    parent = directory.parent
    (parent / "memory.limit_in_bytes").write_text("9223372036854771712\n")  # v1's "no limit"
    (parent / "memory.usage_in_bytes").write_text(f"{10 * GIB}\n")
    assert host_available(root).bytes == 3 * GIB - GIB // 2


@pytest.mark.parametrize("cgroup", ["", "0::/nowhere\n"])
def test_no_cgroup_files_leave_mem_available(tmp_path: Path, cgroup: str) -> None:
    root = fake_host(tmp_path, 7 * GIB, cgroup)
    assert host_available(root).bytes == 7 * GIB


def test_this_machine_has_some() -> None:
    assert host_available().bytes > 0


def test_tensor_parallel_sizes_from_the_checkpoint_s_bytes(monkeypatch: pytest.MonkeyPatch) -> None:
    # The weights are not read (loaders make tensors on demand): their shapes are enough.
    weights = {"a": torch.zeros(1000, 64), "b": torch.zeros(10)}
    monkeypatch.setattr(
        available_memory, "measure", lambda device: AvailableMemory(GIB, "MemAvailable")
    )
    cpu = estimate_after_weights(torch.device("cpu"), weights, torch.bfloat16, 2)
    assert cpu.bytes == GIB - 64_010 * 2 and cpu.source.startswith("estimate: MemAvailable")
    # On CUDA each rank has a GPU of its own, as free as this one.
    gpus = estimate_after_weights(torch.device("cuda"), weights, torch.float32, 2)
    assert gpus.bytes == 2 * GIB - 64_010 * 4
