"""The trace loader (clipping, time scale, num_requests) and the seeded arrival processes."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest

from iterserve.bench.arrivals import ArrivalSpec, arrival_offsets
from iterserve.bench.trace import default_trace_path, load_trace

CSV = """arrived_at,num_prefill_tokens,num_decode_tokens
10.0,374,44
12.5,2000,109
11.0,91,0
16.0,50,700
"""


@pytest.fixture
def trace_csv(tmp_path: Path) -> Path:
    path = tmp_path / "trace.csv"
    path.write_text(CSV)
    return path


def test_trace_rows_sorted_relative_and_unclipped(trace_csv: Path) -> None:
    rows = load_trace(trace_csv)
    assert [r.arrival for r in rows] == [0.0, 1.0, 2.5, 6.0]
    assert [r.prompt_len for r in rows] == [374, 91, 2000, 50]
    assert [r.output_len for r in rows] == [44, 1, 109, 700]  # a 0-token row still asks for 1


def test_trace_clipping_time_scale_and_count(trace_csv: Path) -> None:
    rows = load_trace(
        trace_csv, num_requests=3, time_scale=0.5, max_prompt_len=256, max_output_len=64
    )
    assert len(rows) == 3  # the first three rows of the file
    assert [r.arrival for r in rows] == [0.0, 0.5, 1.25]  # gaps halved
    assert [r.prompt_len for r in rows] == [256, 91, 256]
    assert [r.output_len for r in rows] == [44, 1, 64]
    stretched = load_trace(trace_csv, time_scale=10.0)
    assert stretched[-1].arrival == pytest.approx(60.0)


def test_trace_errors(tmp_path: Path, trace_csv: Path) -> None:
    bad = tmp_path / "bad.csv"
    bad.write_text("t,prompt\n1,2\n")
    with pytest.raises(ValueError, match="lacks column"):
        load_trace(bad)
    with pytest.raises(ValueError, match="time-scale"):
        load_trace(trace_csv, time_scale=0)


def test_bundled_azure_trace_loads() -> None:
    path = default_trace_path()
    assert (path.parent / "LICENSE.vidur").exists()
    rows = load_trace(path, num_requests=200, time_scale=2.0, max_prompt_len=512)
    assert len(rows) == 200 and rows[0].arrival == 0.0
    assert max(r.prompt_len for r in rows) == 512
    arrivals = [r.arrival for r in rows]
    assert arrivals == sorted(arrivals)


def test_poisson_rate_and_count_are_seeded() -> None:
    spec = ArrivalSpec("poisson", request_rate=5.0)
    offsets = arrival_offsets(spec, 2001, seed=1)
    assert len(offsets) == 2001 and offsets[0] == 0.0
    assert offsets == arrival_offsets(spec, 2001, seed=1)
    assert offsets != arrival_offsets(spec, 2001, seed=2)
    rate = 2000 / offsets[-1]
    assert rate == pytest.approx(5.0, rel=0.06)
    gaps = np.diff(offsets)
    assert gaps.std() / gaps.mean() == pytest.approx(1.0, rel=0.08)  # exponential: CV 1


@pytest.mark.parametrize("burstiness", [0.25, 4.0])
def test_gamma_keeps_the_rate_and_sets_the_burstiness(burstiness: float) -> None:
    offsets = arrival_offsets(ArrivalSpec("gamma", 10.0, burstiness), 4001, seed=0)
    gaps = np.diff(offsets)
    assert 1 / gaps.mean() == pytest.approx(10.0, rel=0.08)
    # Gamma with shape k: coefficient of variation 1 / sqrt(k).
    assert gaps.std() / gaps.mean() == pytest.approx(1 / math.sqrt(burstiness), rel=0.1)


def test_closed_loop_infinite_rate_and_trace() -> None:
    assert arrival_offsets(ArrivalSpec("closed", max_concurrency=4), 3) == [0.0] * 3
    assert arrival_offsets(ArrivalSpec("poisson"), 3) == [0.0] * 3  # rate inf: all at once
    trace = [0.0, 0.5, 2.0]
    assert arrival_offsets(ArrivalSpec("trace"), 3, trace_offsets=trace) == trace
    with pytest.raises(ValueError, match="trace"):
        arrival_offsets(ArrivalSpec("trace"), 3)
    with pytest.raises(ValueError, match="max-concurrency"):
        ArrivalSpec("closed").validate()
    with pytest.raises(ValueError):
        ArrivalSpec("poisson", request_rate=0).validate()
