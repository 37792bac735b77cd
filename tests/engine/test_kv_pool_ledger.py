"""The host's ledger of KV pools (engine/kv_pool_ledger.py): each engine's line made with its
pool, kept as its written part grows and removed when it closes; lines of processes that are
gone are ignored and removed; --kv-cache-memory auto takes off what other engines' pools have
reserved and not written. Across real processes: a server's line, read by an engine started
beside it, and gone with the server."""

from __future__ import annotations

import gc
import json
import os
import signal
import subprocess
import sys
import threading
from pathlib import Path

import httpx
import pytest
import torch

from draft_llms import draft_llm
from iterserve.config import EngineConfig
from iterserve.engine import available_memory, kv_pool_ledger
from iterserve.engine.kv_pool_ledger import PoolRecord, Unwritten, live_lines, unwritten_elsewhere
from iterserve.engine.kv_pool_size import AvailableMemory
from iterserve.engine.llm_engine import LLMEngine
from iterserve.sampling_params import SamplingParams
from server_fixtures import free_port, is_healthy, wait_until

MIB = 2**20


def test_a_line_is_written_kept_up_and_removed(tmp_path: Path) -> None:
    record = PoolRecord("m", 100 * MIB, 100, tmp_path)
    (line,) = live_lines(tmp_path)
    assert (line.pid, line.model, line.reserved_bytes, line.written_bytes) == (
        os.getpid(),
        "m",
        100 * MIB,
        0,
    )
    record.record(7)
    assert live_lines(tmp_path)[0].written_bytes == 7 * MIB
    assert unwritten_elsewhere(tmp_path) == Unwritten(93 * MIB, 1)
    record.close()
    record.close()  # idempotent
    assert live_lines(tmp_path) == [] and list(tmp_path.iterdir()) == []


def test_the_line_is_rewritten_only_when_it_has_grown_a_step(tmp_path: Path) -> None:
    record = PoolRecord("m", 1024 * MIB, 1024, tmp_path)  # a step is 4 blocks (1/256)
    record.record(3)
    assert live_lines(tmp_path)[0].written_bytes == 0
    record.record(4)
    record.record(7)
    assert live_lines(tmp_path)[0].written_bytes == 4 * MIB
    record.record(8)
    assert live_lines(tmp_path)[0].written_bytes == 8 * MIB
    record.close()


def test_a_collected_record_removes_its_line(tmp_path: Path) -> None:
    record = PoolRecord("m", MIB, 1, tmp_path)
    assert len(live_lines(tmp_path)) == 1
    del record
    gc.collect()
    assert list(tmp_path.iterdir()) == []


def ledger_process(ledger: Path, script: str) -> subprocess.Popen[str]:
    """Another process running `script` with `ledger` as its ledger, talked to by lines."""
    return subprocess.Popen(
        [sys.executable, "-c", script],
        env={**os.environ, kv_pool_ledger.DIRECTORY_ENV: str(ledger)},
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )


def test_the_line_of_a_killed_process_is_ignored_and_removed(tmp_path: Path) -> None:
    writer = ledger_process(
        tmp_path,
        "import time\n"
        "from iterserve.engine.kv_pool_ledger import PoolRecord\n"
        f"record = PoolRecord('gone', {64 * MIB}, 64)\n"
        "print('ready', flush=True)\n"
        "time.sleep(600)\n",
    )
    try:
        assert writer.stdout is not None and writer.stdout.readline().strip() == "ready"
        assert unwritten_elsewhere(tmp_path) == Unwritten(64 * MIB, 1)
    finally:
        writer.send_signal(signal.SIGKILL)  # no chance to remove its line
        writer.wait()
    assert len(list(tmp_path.glob("*.json"))) == 1
    assert unwritten_elsewhere(tmp_path) == Unwritten(0, 0)
    assert list(tmp_path.glob("*.json")) == []


def test_pools_are_sized_in_turn(tmp_path: Path) -> None:
    """While another process sizes its pool, an engine waits to measure: it then sees the
    other's line."""
    holder = ledger_process(
        tmp_path,
        "import sys\n"
        "from iterserve.engine.kv_pool_ledger import PoolRecord, sizing\n"
        "with sizing():\n"
        "    print('sizing', flush=True)\n"
        "    sys.stdin.readline()\n"
        f"    record = PoolRecord('first', {64 * MIB}, 64)\n"
        "print('sized', flush=True)\n"
        "sys.stdin.readline()\n",
    )
    assert holder.stdin is not None and holder.stdout is not None
    seen: list[Unwritten] = []

    def size_a_pool() -> None:
        with kv_pool_ledger.sizing(tmp_path):
            seen.append(unwritten_elsewhere(tmp_path))

    try:
        assert holder.stdout.readline().strip() == "sizing"
        waiting = threading.Thread(target=size_a_pool)
        waiting.start()
        waiting.join(timeout=1.0)
        assert waiting.is_alive() and seen == []  # held off while the other sizes
        holder.stdin.write("\n")
        holder.stdin.flush()
        assert holder.stdout.readline().strip() == "sized"
        waiting.join(timeout=30)
        assert seen == [Unwritten(64 * MIB, 1)]
    finally:
        holder.stdin.write("\n")
        holder.stdin.flush()
        holder.wait(timeout=30)


def test_a_line_whose_process_id_was_reused_is_ignored(tmp_path: Path) -> None:
    """A live process with the line's id, started at another time, did not write it."""
    record = PoolRecord("m", MIB, 1, tmp_path)
    assert record.path is not None
    line = json.loads(record.path.read_text())
    record.close()
    if line["start_time"] is None:
        pytest.skip("no /proc: a process's start time is not known here")
    line["start_time"] -= 1
    (tmp_path / "forged.json").write_text(json.dumps(line))
    (tmp_path / "junk.json").write_text("not a line")
    assert live_lines(tmp_path) == []
    assert [p.name for p in tmp_path.iterdir()] == ["junk.json"]


def test_a_directory_that_cannot_be_written_leaves_the_engine_without_a_line(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    blocked = tmp_path / "a-file"
    blocked.write_text("")
    record = PoolRecord("m", MIB, 1, blocked / "pools")
    assert record.path is None and "KV pool not recorded" in caplog.text
    record.record(1)
    record.close()
    with kv_pool_ledger.sizing(blocked / "pools"):  # no lock to take: sized unlocked
        pass


def test_the_default_directory_is_shared_memory_unless_named(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setenv(kv_pool_ledger.DIRECTORY_ENV, str(tmp_path))
    assert kv_pool_ledger.directory() == tmp_path
    monkeypatch.delenv(kv_pool_ledger.DIRECTORY_ENV)
    default = kv_pool_ledger.directory()
    assert default.name == "iterserve-kv-pools"
    if Path("/dev/shm").is_dir() and os.access("/dev/shm", os.W_OK):
        assert default.parent == Path("/dev/shm")


def test_auto_takes_off_what_other_pools_have_not_written(
    monkeypatch: pytest.MonkeyPatch, kv_pools_dir: Path
) -> None:
    monkeypatch.setattr(
        available_memory, "host_available", lambda: AvailableMemory(10 * 2**30, "MemAvailable")
    )
    assert available_memory.measure(torch.device("cpu")) == AvailableMemory(
        10 * 2**30, "MemAvailable"
    )
    other = PoolRecord("other", 4 * 2**30, 4096, kv_pools_dir)
    other.record(1024)
    reading = available_memory.measure(torch.device("cpu"))
    assert reading == AvailableMemory(
        7 * 2**30,
        "MemAvailable less 3.00 GiB reserved and not yet written by 1 other iterserve KV pool",
        reserved_elsewhere=3 * 2**30,
    )
    big = PoolRecord("big", 20 * 2**30, 1, kv_pools_dir)
    assert available_memory.measure(torch.device("cpu")).bytes == 0  # never below nothing
    other.close()
    big.close()


def test_an_engine_sizes_its_pool_around_a_running_server_s(
    tiny_llama_dir: Path, kv_pools_dir: Path
) -> None:
    """Server A in its own process records its pool; engine B, started beside it, takes A's
    unwritten part off what it measures; A's line follows what it writes, and goes with A."""
    port = free_port()
    command = [
        sys.executable, "-m", "iterserve.cli", "serve", str(tiny_llama_dir),
        "--port", str(port), "--dtype", "float32", "--enforce-eager", "--max-num-seqs", "4",
    ]  # fmt: skip
    server = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)
    base = f"http://127.0.0.1:{port}"
    try:
        assert wait_until(lambda: is_healthy(base), timeout=90, interval=0.2), "no server"
        health = httpx.get(f"{base}/health").json()["model"]
        (line,) = live_lines(kv_pools_dir)
        assert line.pid == server.pid and line.reserved_bytes == int(health["kv_cache_bytes"])
        engine = LLMEngine(EngineConfig(model=str(tiny_llama_dir), dtype="float32", compile=False))
        try:
            assert engine.kv_pool.available is not None
            assert engine.kv_pool.available.reserved_elsewhere == line.unwritten_bytes > 0
            assert "1 other iterserve KV pool" in engine.kv_pool.available.source
        finally:
            engine.close()
        assert [p.pid for p in live_lines(kv_pools_dir)] == [server.pid]  # B's line is gone
        reply = httpx.post(
            f"{base}/v1/completions", json={"prompt": [7] * 300, "max_tokens": 4}, timeout=60
        )
        assert reply.status_code == 200, reply.text
        metrics = httpx.get(f"{base}/metrics").text
        (written,) = [
            float(row.split()[-1])
            for row in metrics.splitlines()
            if row.startswith("iterserve:kv_cache_written_bytes")
        ]
        # The tiny pool has fewer than 256 blocks: its line is rewritten at every new block.
        assert live_lines(kv_pools_dir)[0].written_bytes == int(written) > 0
    finally:
        server.send_signal(signal.SIGTERM)
        server.wait(timeout=60)
    assert list(kv_pools_dir.glob("*.json")) == []


def test_a_draft_model_s_pool_has_its_own_line(tiny_llama_dir: Path, kv_pools_dir: Path) -> None:
    # Under 256 blocks, a line is rewritten at every block newly written.
    settings = {"num_speculative_tokens": 3, "num_kv_blocks": 64}
    with draft_llm(tiny_llama_dir, tiny_llama_dir, **settings) as llm:
        engine = llm.engine
        assert engine.draft is not None
        by_model = {line.model: line for line in live_lines(kv_pools_dir)}
        assert by_model.keys() == {engine.model_name, f"{engine.model_name} (its draft)"}
        draft_line = by_model[f"{engine.model_name} (its draft)"]
        assert draft_line.reserved_bytes == engine.draft.network.kv_cache_bytes > 0
        assert draft_line.written_bytes == 0
        llm.generate([[7] * 40], SamplingParams(max_tokens=8, ignore_eos=True))
        written = engine.draft.pool.num_written_blocks
        assert written > 0
        by_model = {line.model: line for line in live_lines(kv_pools_dir)}
        pool = engine.draft.pool
        assert by_model[f"{engine.model_name} (its draft)"].written_bytes == (
            draft_line.reserved_bytes * written // pool.num_blocks
        )
    assert live_lines(kv_pools_dir) == []


def test_a_group_of_equals_splits_one_share_and_counts_no_sibling(
    tiny_llama_dir: Path, kv_pools_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Data-parallel replicas on one host ($ITERSERVE_KV_POOL_GROUP "name:size"): each takes
    the fraction over the group's size, and a sibling's line is not taken off; an engine
    outside the group counts it."""
    monkeypatch.setattr(
        available_memory, "host_available", lambda: AvailableMemory(2**30, "MemAvailable")
    )
    monkeypatch.setenv(kv_pool_ledger.GROUP_ENV, "replicas-x:2")
    sibling = PoolRecord("sibling", 256 * MIB, 256, kv_pools_dir)
    monkeypatch.delenv(kv_pool_ledger.GROUP_ENV)
    stranger = PoolRecord("stranger", 128 * MIB, 128, kv_pools_dir)
    assert unwritten_elsewhere(kv_pools_dir) == Unwritten(384 * MIB, 2)
    monkeypatch.setenv(kv_pool_ledger.GROUP_ENV, "replicas-x:2")
    assert unwritten_elsewhere(kv_pools_dir) == Unwritten(128 * MIB, 1)
    config = EngineConfig(model=str(tiny_llama_dir), dtype="float32", compile=False)
    engine = LLMEngine(config, warm_up=False)
    try:
        pool = engine.kv_pool
        assert pool.fraction == 0.25 and pool.available is not None
        assert pool.available.bytes == 2**30 - 128 * MIB
        mine = [line for line in live_lines(kv_pools_dir) if line.pid == os.getpid()]
        assert {line.group for line in mine} == {"replicas-x", None}  # the sibling's, its own
    finally:
        engine.close()
        sibling.close()
        stranger.close()


def test_a_member_that_starts_again_sizes_from_the_group_s_share(
    kv_pools_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A replica restarted beside a sibling that has written 300 MiB of its pool: that memory
    is out of MemAvailable, and is the group's share, so the pool is measured as before."""
    monkeypatch.setattr(
        available_memory, "host_available", lambda: AvailableMemory(2**30, "MemAvailable")
    )
    monkeypatch.setenv(kv_pool_ledger.GROUP_ENV, "replicas-y:2")
    sibling = PoolRecord("sibling", 512 * MIB, 512, kv_pools_dir)
    sibling.record(300)
    reading = available_memory.measure(torch.device("cpu"))
    assert reading.bytes == 2**30 + 300 * MIB and reading.reserved_elsewhere == 0
    assert "plus 0.29 GiB its group's other pools have written" in reading.source
    # The weights' check reads the memory as it is.
    assert available_memory.host_room() == AvailableMemory(2**30, "MemAvailable")
    monkeypatch.delenv(kv_pool_ledger.GROUP_ENV)  # outside the group: its unwritten is taken
    assert available_memory.measure(torch.device("cpu")).bytes == 2**30 - 212 * MIB
    sibling.close()
