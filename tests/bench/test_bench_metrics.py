"""The benchmark's metric math against hand-worked examples."""

from __future__ import annotations

import math
import random
from collections import Counter
from dataclasses import astuple

import numpy as np
import pytest

from iterserve.bench import metrics
from iterserve.bench.metrics import (
    Distribution,
    TokenTimes,
    compute_metrics,
    inter_token_gaps,
    max_concurrency,
    meets_slos,
    parse_slos,
    peak_output_throughput,
    percentile,
)
from iterserve.bench.plot import find_knee
from iterserve.bench.records import RequestRecord
from iterserve.bench.report import BenchReport, format_report, latency_dict


def record(
    arrival: float,
    tokens: list[float],
    finish: float | None = None,
    prompt_len: int = 10,
    output_len: int | None = None,
    scheduled: float | None = None,
    lane: str = "interactive",
) -> RequestRecord:
    r = RequestRecord("r", prompt_len, len(tokens), lane, arrival, arrival)
    r.first_scheduled_time = scheduled
    r.first_token_time = tokens[0] if tokens else None
    r.token_times = list(tokens)
    r.finish_time = finish if finish is not None else (tokens[-1] if tokens else arrival)
    r.output_len = len(tokens) if output_len is None else output_len
    r.success = True
    return r


def test_percentiles_interpolate_linearly() -> None:
    # Order statistics 1..4 at ranks 0..3: p50 sits at rank 1.5, p90 at 2.7, p99 at 2.97.
    values = [4.0, 1.0, 3.0, 2.0]
    assert percentile(values, 50) == pytest.approx(2.5)
    assert percentile(values, 90) == pytest.approx(3.7)
    assert percentile(values, 99) == pytest.approx(3.97)
    assert percentile([7.0], 99) == 7.0
    d = Distribution.of([0.001, 0.002, 0.003, 0.004])  # seconds in, milliseconds out
    assert (d.mean, d.median, d.p90, d.p99, d.count) == pytest.approx((2.5, 2.5, 3.7, 3.97, 4))
    assert Distribution.of([]) is None
    with pytest.raises(ValueError):
        percentile([], 50)


def test_request_latencies_and_tpot_excludes_the_first_token() -> None:
    # Arrives at 1.0, first token at 1.5 (a long prefill), then tokens 0.1 and 0.3 apart.
    r = record(1.0, [1.5, 1.6, 1.9], finish=2.0, scheduled=1.2)
    assert r.ttft == pytest.approx(0.5)
    assert r.queue_time == pytest.approx(0.2)
    assert r.itls == pytest.approx([0.1, 0.3])
    # (1.9 - 1.5) / (3 - 1): the 0.5 s wait for the first token is not spread over the rest.
    assert r.tpot == pytest.approx(0.2)
    assert r.e2e == pytest.approx(1.0)
    assert r.max_itl == pytest.approx(0.3)


def test_tpot_uses_the_reported_token_count_not_the_chunks() -> None:
    # A server streamed 5 tokens in 3 chunks: 4 gaps of output after the first token.
    r = record(0.0, [0.5, 0.7, 0.9], output_len=5)
    assert r.tpot == pytest.approx((0.9 - 0.5) / 4)
    one = record(0.0, [0.5])
    assert one.tpot is None and one.itls == []


def test_slo_parsing_units() -> None:
    slos = parse_slos("ttft=500ms, tpot=0.1s,itl=50000us,e2el=2000")
    assert slos == pytest.approx({"ttft": 0.5, "tpot": 0.1, "tbt": 0.05, "e2e": 2.0})
    assert parse_slos(None) == {} and parse_slos("") == {}
    for bad in ("ttft", "speed=3ms", "ttft=fast", "ttft=0ms"):
        with pytest.raises(ValueError):
            parse_slos(bad)


def test_goodput_counts_requests_meeting_every_slo() -> None:
    slos = parse_slos("ttft=500ms,tpot=100ms")
    fast = record(0.0, [0.2, 0.25, 0.3], finish=1.0)  # ttft 0.2, tpot 0.05: meets both
    slow_start = record(1.0, [1.6, 1.65], finish=2.0)  # ttft 0.6: misses ttft
    slow_stream = record(2.0, [2.1, 2.4, 2.7], finish=3.0)  # tpot 0.3: misses tpot
    single = record(3.0, [3.1], finish=4.0)  # no tpot: nothing to violate
    failed = RequestRecord("f", 10, 3, arrival_time=0.0)
    assert [meets_slos(r, slos) for r in (fast, slow_start, slow_stream, single, failed)] == [
        True,
        False,
        False,
        True,
        False,
    ]
    metrics = compute_metrics([fast, slow_start, slow_stream, single, failed], slos=slos)
    # 2 of the requests met all SLOs over a 4 s run.
    assert metrics.goodput is not None and metrics.goodput.num_met == 2
    assert metrics.throughput.request_goodput == pytest.approx(0.5)


def test_throughput_block_by_hand() -> None:
    a = record(0.0, [0.5, 1.0, 1.5, 2.0], prompt_len=100)  # 4 tokens
    b = record(1.0, [1.2, 1.4], finish=4.0, prompt_len=50)  # 2 tokens, finishes at 4 s
    failed = RequestRecord("x", 999, 9, arrival_time=0.5)
    t = compute_metrics([a, b, failed]).throughput
    assert (t.completed, t.failed, t.duration) == (2, 1, 4.0)
    assert (t.total_input_tokens, t.total_output_tokens) == (150, 6)  # failed counts nowhere
    assert t.request_throughput == pytest.approx(0.5)
    assert t.input_throughput == pytest.approx(37.5)
    assert t.output_throughput == pytest.approx(1.5)
    assert t.total_token_throughput == pytest.approx(39.0)
    # Tokens per one-second bucket: [0,1): 1, [1,2): 4 (1.0, 1.2, 1.4, 1.5), [2,3): 1.
    assert t.max_output_tokens_per_s == 4.0
    assert t.max_concurrent_requests == 2


def test_latency_block_pools_gaps_and_skips_failures() -> None:
    a = record(0.0, [0.1, 0.2, 0.4])
    b = record(0.0, [0.3, 0.6])
    broken = RequestRecord("x", 1, 1)
    lat = compute_metrics([a, b, broken]).latency
    assert lat.ttft.count == 2 and lat.ttft.mean == pytest.approx(200.0)
    assert lat.itl.count == 3 and lat.itl.mean == pytest.approx((100 + 200 + 300) / 3)
    assert lat.tpot.mean == pytest.approx((150 + 300) / 2)
    assert lat.queue is None  # no admission times: a client's view
    d = latency_dict(lat)
    assert d["mean_ttft_ms"] == pytest.approx(200.0) and d["p99_queue_ms"] is None


def test_peak_counts_unstreamed_tokens_with_the_last_chunk() -> None:
    r = record(0.0, [0.1, 0.2], output_len=5)
    assert peak_output_throughput([r]) == 5.0
    assert max_concurrency([]) == 0


def test_per_lane_blocks_and_prefix_hit_rate() -> None:
    chat = record(0.0, [0.1, 0.2], lane="interactive")
    doc = record(0.0, [0.9, 1.0], lane="batch", prompt_len=30)
    chat.num_cached_tokens, doc.num_cached_tokens = 0, 20
    m = compute_metrics([chat, doc])
    assert set(m.lanes) == {"interactive", "batch"}
    assert m.lanes["batch"].ttft.mean == pytest.approx(900.0)
    assert m.prefix_cache_hit_rate == pytest.approx(20 / 40)


def test_draft_acceptance_pools_the_requests_that_report_it() -> None:
    a, b, plain = record(0.0, [0.1, 0.2]), record(0.0, [0.1, 0.2]), record(0.0, [0.1, 0.2])
    a.num_draft_tokens, a.num_accepted_tokens = 10, 9
    b.num_draft_tokens, b.num_accepted_tokens = 30, 3
    m = compute_metrics([a, b, plain])
    assert m.spec_acceptance_rate == pytest.approx(12 / 40)
    workload = {"name": "synthetic", "num_requests": 3, "mean_prompt_len": 10.0}
    report = BenchReport("x", "offline", "m", workload | {"mean_output_len": 2.0}, "all", m)
    assert "Draft acceptance rate:" in format_report(report)
    assert report.to_dict()["spec_acceptance_rate"] == pytest.approx(0.3)
    assert compute_metrics([plain]).spec_acceptance_rate is None


def test_report_prints_the_blocks_apart() -> None:
    m = compute_metrics([record(0.0, [0.1, 0.2])], slos=parse_slos("ttft=1s"))
    workload = {"name": "synthetic", "num_requests": 1, "mean_prompt_len": 10.0}
    report = BenchReport("x", "offline", "m", workload | {"mean_output_len": 2.0}, "all", m)
    text = format_report(report)
    assert text.index("Throughput") < text.index("Latency")
    assert "Request goodput (req/s):" in text and "TPOT" in text and "TBT (ITL)" in text
    assert set(report.to_dict()) >= {"throughput", "latency", "goodput"}


def test_knee_is_the_last_point_before_latency_outruns_throughput() -> None:
    # tput x2 while latency +10%, then tput +10% while latency x3: knee at index 1.
    assert find_knee([100, 200, 220, 225], [10, 11, 33, 90]) == 1
    assert find_knee([100, 200, 400], [10, 10, 12]) is None  # latency never outruns
    assert find_knee([100, 90], [10, 12]) == 0  # falling throughput, rising latency
    assert find_knee([], []) is None
    assert find_knee([1, 2, 3], [1, 1.5, 5]) == 1


@pytest.mark.parametrize("chunk", [3, 1 << 22])
def test_pooled_figures_match_their_per_token_definitions(
    chunk: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """peak_output_throughput, the TBT gaps and max_concurrency run in numpy (a simulated
    million requests carry ~2e8 token times), a chunk at a time; each against its plain
    definition."""
    monkeypatch.setattr(metrics, "_CHUNK", chunk)
    rng = random.Random(1)
    for _ in range(200):
        records = []
        for i in range(rng.randint(0, 8)):
            start = rng.uniform(0, 5)
            times = sorted(start + rng.uniform(0, 3) for _ in range(rng.choice([0, 1, 2, 5])))
            records.append(
                RequestRecord(
                    f"r{i}",
                    3,
                    4,
                    arrival_time=start,
                    token_times=times,
                    finish_time=times[-1] if times else None,
                    output_len=len(times) + rng.choice([0, 0, 2]),
                    success=rng.random() < 0.9,
                )  # fmt: skip
            )
        buckets: Counter[int] = Counter()
        for r in records:
            if r.success and r.token_times:
                for t in r.token_times:
                    buckets[math.floor(t / 0.5)] += 1
                buckets[math.floor(r.token_times[-1] / 0.5)] += r.output_len - len(r.token_times)
        assert peak_output_throughput(records, 0.5) == max(buckets.values(), default=0) / 0.5
        ok = [r for r in records if r.success]
        gaps = sorted(g for r in ok for g in r.itls)
        assert sorted(inter_token_gaps(ok)) == gaps
        assert sorted(inter_token_gaps(ok, TokenTimes.of(ok), reuse=True)) == gaps
        if gaps:
            plain = astuple(Distribution.of(np.array(gaps)))
            assert astuple(Distribution.of(np.array(gaps), in_place=True)) == pytest.approx(plain)
        level = peak = 0
        events = [(r.arrival_time, 1) for r in records if r.finish_time is not None]
        events += [(r.finish_time, -1) for r in records if r.finish_time is not None]
        for _, delta in sorted(events):
            level += delta
            peak = max(peak, level)
        assert max_concurrency(records) == peak
