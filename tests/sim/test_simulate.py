"""The simulator: the real scheduler on a cost model and a virtual clock (no torch model)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from iterserve.bench.arrivals import ArrivalSpec, arrival_offsets
from iterserve.bench.metrics import compute_metrics
from iterserve.bench.workloads import WorkloadSpec, build_workload
from iterserve.config import EngineConfig, SchedulerConfig, SpeculativeConfig
from iterserve.core.outputs import ScheduledSeq, SchedulerOutput
from iterserve.sampling_params import SamplingParams
from iterserve.sim.executor import HARDWARE, MODELS, RooflineCostModel
from iterserve.sim.fleet import simulate_fleet


@pytest.fixture(scope="module")
def workload(tokenizer_dir: Path):  # type: ignore[no-untyped-def]
    from transformers import AutoTokenizer

    spec = WorkloadSpec(
        num_requests=60, input_len=400, output_len=120, length_dist="uniform", range_ratio=0.9
    )
    return build_workload(spec, AutoTokenizer.from_pretrained(tokenizer_dir))


def run(workload, **scheduler: object):  # type: ignore[no-untyped-def]
    config = EngineConfig(scheduler=SchedulerConfig(**scheduler))  # type: ignore[arg-type]
    offsets = arrival_offsets(ArrivalSpec(request_rate=20.0), len(workload.requests), seed=1)
    records, fleet = simulate_fleet(config, workload, offsets, "a100-80g", "llama3-8b")
    return compute_metrics(records), fleet[0].scheduler, fleet[0].executor


def test_every_request_completes_with_its_length(workload) -> None:  # type: ignore[no-untyped-def]
    metrics, scheduler, _ = run(workload)
    assert metrics.throughput.completed == 60 and metrics.throughput.failed == 0
    assert metrics.throughput.total_output_tokens == sum(r.output_len for r in workload.requests)
    assert scheduler.kv_cache_stats().num_used_blocks == 0


def test_continuous_batching_beats_static_on_mixed_lengths(workload) -> None:  # type: ignore[no-untyped-def]
    continuous, _, _ = run(workload, max_num_seqs=16)
    static, _, _ = run(workload, batching="static", batch_size=16, max_num_seqs=16)
    # Deterministic virtual time: static batches hold finished slots until the longest ends.
    assert continuous.throughput.output_throughput > 1.2 * static.throughput.output_throughput
    assert continuous.latency.ttft.p99 < static.latency.ttft.p99


def test_roofline_is_memory_bound_for_decode_and_compute_bound_for_prefill() -> None:
    cost = RooflineCostModel(HARDWARE["a100-80g"], MODELS["llama3-8b"])
    params = SamplingParams()

    def step(n_new: int, n_seqs: int, computed: int) -> float:
        seqs = [
            ScheduledSeq(str(i), [0] * n_new, computed, (), True, params) for i in range(n_seqs)
        ]
        return cost.step_time(SchedulerOutput(seqs, num_prefill_tokens=n_new * n_seqs))

    one, eight = step(1, 1, 100), step(1, 8, 100)
    assert eight < 1.2 * one, "small decode batches cost about the weights' read time"
    assert step(2048, 1, 0) > 4 * step(256, 1, 0) > 0, "long prefills cost their FLOPs"


@pytest.mark.parametrize("rate", [0.0, 0.6, 1.0])
def test_speculation_is_modelled_at_its_acceptance_rate(workload, rate: float) -> None:  # type: ignore[no-untyped-def]
    """Each of k guesses kept with chance `rate` up to the first refusal: the measured rate
    is sum(rate^i, i=1..k) / k, every request still gets exactly its length, and at a
    light load a high rate shortens the time per output token."""
    k = 4
    config = EngineConfig(speculative=SpeculativeConfig("ngram", num_speculative_tokens=k))
    offsets = arrival_offsets(ArrivalSpec(request_rate=2.0), len(workload.requests), seed=1)
    records, fleet = simulate_fleet(
        config, workload, offsets, "a100-80g", "llama3-8b", acceptance_rate=rate
    )
    metrics = compute_metrics(records)
    assert metrics.throughput.total_output_tokens == sum(r.output_len for r in workload.requests)
    stats = fleet[0].scheduler.spec_stats
    expected = sum(rate**i for i in range(1, k + 1)) / k
    assert stats.num_draft_tokens > 0
    assert stats.acceptance_rate == pytest.approx(expected, abs=0.05)
    plain_records, _ = simulate_fleet(EngineConfig(), workload, offsets, "a100-80g", "llama3-8b")
    plain = compute_metrics(plain_records)
    if rate == 1.0:
        assert metrics.latency.tpot.mean < 0.6 * plain.latency.tpot.mean


def test_an_int8_kv_pool_holds_more_tokens_and_reads_fewer_bytes() -> None:
    """--kv-cache-dtype int8 in the simulator: rows of head_dim bytes and a 4-byte scale
    (model/kv_cache_format.py) where bf16 ones are 2 * head_dim bytes."""
    from iterserve.config import CacheConfig
    from iterserve.sim.fleet import kv_blocks_for

    int8 = EngineConfig(cache=CacheConfig(kv_cache_dtype="int8"))
    for model, head_dim in (("smollm2-135m", 64), ("llama3-8b", 128)):
        bf16_blocks = kv_blocks_for(EngineConfig(), "cpu-2core", model)
        int8_blocks = kv_blocks_for(int8, "cpu-2core", model)
        assert int8_blocks / bf16_blocks == pytest.approx(2 * head_dim / (head_dim + 4), rel=1e-3)
    shape = MODELS["smollm2-135m"]
    assert shape.with_kv_cache_dtype("int8").kv_bytes_per_token == 2 * 30 * 3 * (64 + 4)


def test_this_machine_s_preset_sizes_the_kv_pool_as_the_engine_does() -> None:
    """cpu-2core: what `iterserve serve` here allocates (--kv-cache-memory GiB, or auto: its
    share of the preset's 24 GiB less the weights, at most what the sequences can use); a GPU
    preset: the device's memory less the weights, as GPU serving engines do."""
    from iterserve.config import CacheConfig
    from iterserve.sim.fleet import kv_blocks_for

    shape = MODELS["smollm2-135m"]
    per_block = shape.kv_bytes_per_token * 16
    auto = kv_blocks_for(EngineConfig(), "cpu-2core", "smollm2-135m")
    assert auto == int(0.5 * (24 * 2**30 - shape.weight_bytes) // per_block)
    quarter = EngineConfig(cache=CacheConfig(kv_cache_memory_fraction=0.25))
    assert kv_blocks_for(quarter, "cpu-2core", "smollm2-135m") == pytest.approx(auto / 2, abs=1)
    short = EngineConfig(scheduler=SchedulerConfig(max_num_seqs=8, max_model_len=1000))
    assert kv_blocks_for(short, "cpu-2core", "smollm2-135m") == 8 * 63  # 1000 tokens: 63 blocks
    half = EngineConfig(cache=CacheConfig(kv_cache_memory=0.5))
    assert kv_blocks_for(half, "cpu-2core", "smollm2-135m") == int(2**29 // per_block)
    gpu = kv_blocks_for(EngineConfig(), "a100-80g", "smollm2-135m")
    assert gpu == int((0.9 * 80e9 - shape.weight_bytes) // per_block)


def test_simulate_reports_what_each_replica_failure_cost(
    capsys: pytest.CaptureFixture[str], tokenizer_dir: Path
) -> None:
    from iterserve.cli import main

    argv = ["simulate", "--model", str(tokenizer_dir), "--num-requests", "150"]
    argv += ["--input-len", "256", "--output-len", "64", "--request-rate", "40"]
    argv += ["--replicas", "3", "--hardware", "a100-80g", "--sim-model", "llama3-8b"]
    assert (
        main([*argv, "--replica-failures", "t=1,replica=1,down=2", "t=1.5,replica=2,down=1"]) == 0
    )
    out = capsys.readouterr().out
    assert re.search(r"failure: replica 1 down at 1\.\d+s for 2s: [1-9]\d* requests lost", out)
    assert re.search(r"failure: replica 2 down at 1\.\d+s for 1s: ", out)
    assert re.search(r"with the failures / without \(a second replay\): p99 TTFT \d+ / \d+ ms", out)
    assert "replica 1 (down 1x; figures since its return at 3." in out
    assert main([*argv, "--replica-failures", "t=1,replica=3,down=2"]) == 2
    assert "names replica 3, but the fleet has 3 (0..2)" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main([*argv, "--replica-failures", "replica=1"])
    assert "is not t=SECONDS,replica=INDEX,down=SECONDS" in capsys.readouterr().err
