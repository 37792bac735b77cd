"""The benchmark end to end on a tiny random model: against a live `iterserve serve` on a
loopback port (both report blocks, a 2-point sweep with its PNG), and in-process."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from iterserve.bench.arrivals import ArrivalSpec
from iterserve.bench.offline import OfflineOptions, benchmark_config
from iterserve.bench.server_process import ServerProcess, engine_flags, launch_server
from iterserve.bench.sweep import point_arrival, variants_from
from iterserve.bench.tokenizer import load_tokenizer
from iterserve.bench.workloads import WorkloadSpec, build_workload
from iterserve.cli import main
from iterserve.config import CacheConfig, EngineConfig, SchedulerConfig

SMALL = ["--input-len", "24", "--output-len", "8", "--disable-tqdm"]


def tiny_config(model_dir: Path, **scheduler: object) -> EngineConfig:
    return EngineConfig(
        model=str(model_dir),
        compile=False,
        cache=CacheConfig(num_kv_blocks=256),
        scheduler=SchedulerConfig(max_model_len=512, **scheduler),  # type: ignore[arg-type]
    )


@pytest.fixture(scope="module")
def server(tiny_llama_dir: Path) -> Iterator[ServerProcess]:
    # A real child process through the real CLI: what a user benchmarks.
    with launch_server(tiny_config(tiny_llama_dir), startup_timeout=120) as running:
        yield running


def test_engine_flags_reproduce_a_config() -> None:
    config = EngineConfig(
        model="m",
        cache=CacheConfig(enable_prefix_caching=False),
        scheduler=SchedulerConfig(batching="static", max_num_seqs=8),
    )
    assert engine_flags(config) == [
        "--model",
        "m",
        "--no-enable-prefix-caching",
        "--max-num-seqs",
        "8",
        "--batching",
        "static",
    ]


def test_sweep_variants_and_point_arrivals() -> None:
    variants = variants_from({"batching": ["continuous", "static"], "prefix_caching": ["off"]})
    assert [v.label for v in variants] == ["continuous", "static"]  # one value: not a label
    static = variants[1].apply(EngineConfig())
    assert static.scheduler.batching == "static" and not static.cache.enable_prefix_caching
    assert EngineConfig().scheduler.batching == "continuous"  # the base is left alone
    both = variants_from({"prefix_caching": ["on", "off"], "max_num_seqs": ["8"]})
    assert [v.label for v in both] == ["prefix-caching on", "prefix-caching off"]
    assert point_arrival(ArrivalSpec("gamma", 1.0, 0.5), "request_rate", 4.0) == ArrivalSpec(
        "gamma", 4.0, 0.5
    )
    closed = point_arrival(ArrivalSpec(), "max_concurrency", 8)
    assert (closed.process, closed.max_concurrency) == ("closed", 8)
    with pytest.raises(ValueError):
        variants_from({"prefix_caching": ["maybe"]})


def test_bench_serve_prints_both_blocks(
    server: ServerProcess, tiny_llama_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    result = tmp_path / "serve.json"
    argv = ["bench", "serve", "--base-url", server.base_url, "--tokenizer", str(tiny_llama_dir)]
    argv += ["--workload", "mixed-chat-docs", "--num-requests", "10", "--doc-len", "120"]
    argv += ["--doc-output-len", "3", "--request-rate", "40", "--slo", "ttft=5s,tpot=1s"]
    argv += ["--result-json", str(result), *SMALL]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert out.index(" Throughput ") < out.index(" Latency ")
    for line in ("Output token throughput (tok/s):", "Request goodput (req/s):", "TTFT", "TPOT"):
        assert line in out
    assert "Latency, batch lane" in out  # documents went to the batch lane

    report = json.loads(result.read_text())
    t = report["throughput"]
    assert (t["completed"], t["failed"]) == (10, 0)
    # ignore_eos: 8 chats of 8 tokens and 2 documents of 3, exactly as asked.
    assert t["total_output_tokens"] == 8 * 8 + 2 * 3
    assert report["latency"]["p99_ttft_ms"] > 0 and report["latency"]["mean_tpot_ms"] > 0
    assert report["latency"]["mean_queue_ms"] is None  # not visible to a client
    assert report["goodput"]["num_met"] == 10


def test_sweep_against_live_server_writes_table_json_and_png(
    server: ServerProcess, tiny_llama_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    out_dir = tmp_path / "sweep"
    argv = ["bench", "sweep", "--base-url", server.base_url, "--tokenizer", str(tiny_llama_dir)]
    argv += ["--request-rates", "20,inf", "--num-requests", "6", "--output-dir", str(out_dir)]
    assert main([*argv, *SMALL]) == 0
    png = out_dir / "sweep.png"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    data = json.loads((out_dir / "sweep.json").read_text())
    assert [p["request_rate"] for p in data["points"]] == [20.0, "inf"]
    assert all(p["throughput"]["completed"] == 6 for p in data["points"])
    table = capsys.readouterr().out
    assert "p99 TTFT" in table and "out tok/s" in table


def test_offline_report_is_a_dataclass_per_engine_config(tiny_llama_dir: Path) -> None:
    # What `iterserve compare` builds on: one workload, one EngineConfig, one BenchReport.
    workload = build_workload(
        WorkloadSpec("shared-prefix", num_requests=8, input_len=8, output_len=4, prefix_len=64),
        load_tokenizer(str(tiny_llama_dir)),
    )
    options = OfflineOptions(progress=False)
    reports = {
        batching: benchmark_config(
            tiny_config(tiny_llama_dir, batching=batching, batch_size=4),
            workload,
            ArrivalSpec("closed", max_concurrency=4),
            options=options,
        )
        for batching in ("continuous", "static")
    }
    for report in reports.values():
        t = report.metrics.throughput
        assert (t.completed, t.total_output_tokens) == (8, 32)
        assert t.max_concurrent_requests <= 4
        assert report.metrics.latency.queue is not None  # the engine's own timings
        # The first 4 prefill together, cold; the next 4 find the 64 shared tokens cached.
        assert report.metrics.prefix_cache_hit_rate == pytest.approx(4 * 64 / (8 * 72))
        assert report.engine_config is not None
    assert reports["static"].engine_config["scheduler"]["batching"] == "static"


def test_offline_sweep_and_transformers_peer(
    tiny_llama_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    out_dir = tmp_path / "sweep"
    argv = ["bench", "sweep", "--model", str(tiny_llama_dir), "--num-kv-blocks", "256"]
    argv += ["--batching", "continuous,static", "--batch-size", "4", "--concurrencies", "2,4"]
    argv += ["--num-requests", "8", "--output-dir", str(out_dir), *SMALL]
    assert main(argv) == 0
    data = json.loads((out_dir / "sweep.json").read_text())
    assert sorted({p["label"] for p in data["points"]}) == ["continuous", "static"]
    assert (out_dir / "sweep.png").stat().st_size > 0

    result = tmp_path / "offline.json"
    argv = ["bench", "offline", "--model", str(tiny_llama_dir), "--num-kv-blocks", "256"]
    argv += ["--num-requests", "8", "--peer", "transformers", "--peer-batch-sizes", "2,8"]
    argv += ["--result-json", str(result), *SMALL]
    assert main(argv) == 0
    assert "iterserve / peer, output tok/s:" in capsys.readouterr().out
    peer = json.loads(result.read_text())["peer"]
    assert peer["batch_size"] in (2, 8) and set(peer["probes"]) == {"2", "8"}
    assert peer["throughput"]["total_output_tokens"] == 64
    assert peer["output_throughput_ratio"] > 0


def test_a_clean_servers_temporary_log_is_removed_at_stop(tiny_llama_dir: Path) -> None:
    # Every test that starts a server used to leave an empty iterserve-serve-*.log in /tmp.
    running = launch_server(tiny_config(tiny_llama_dir), startup_timeout=120)
    log = running.log_path
    assert log.exists()
    running.stop()
    assert running.process.returncode in (0, -signal.SIGTERM), running.log_tail()
    assert not log.exists()


def test_a_temporary_log_with_something_in_it_stays_to_be_read(tmp_path: Path) -> None:
    log = tmp_path / "serve.log"
    log.write_text("Traceback: what went wrong\n")
    process = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    ServerProcess(process, "http://127.0.0.1:1", log, temporary_log=True).stop()
    assert process.returncode == -signal.SIGTERM
    assert log.read_text() == "Traceback: what went wrong\n"
