"""benchmarks/big_models.py --rounds: iterserve's / llama.cpp's figure is taken round by round,
only from rounds where both ran, and summed up by the median of those ratios; --b1-segments:
a run's batch-1 share is the median of its segments', each against its own two readings."""

from __future__ import annotations

import importlib
import sys
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"


@pytest.fixture
def big_models(monkeypatch: pytest.MonkeyPatch) -> Iterator[ModuleType]:
    monkeypatch.syspath_prepend(str(BENCHMARKS))  # it imports its sibling _results
    module = importlib.import_module("big_models")
    yield module
    sys.modules.pop("big_models", None)


def _row(
    engine: str, round_: int, decode: dict[int, float], status: str = "ok", **more: Any
) -> dict[str, Any]:
    row = {"engine": engine, "round": round_, "status": status, "decode": decode, "prompt": {}}
    return {**row, **more}


def test_ratios_pair_each_round_and_take_the_median(big_models: ModuleType) -> None:
    rows = [
        _row("iterserve", 1, {1: 40.0, 16: 220.0}),
        _row("llama.cpp", 1, {1: 40.0, 16: 100.0}),
        _row("llama.cpp", 2, {1: 30.0, 16: 90.0}),
        _row("iterserve", 2, {1: 36.0, 16: 225.0}),
        _row("iterserve", 3, {1: 50.0, 16: 240.0}),
        _row("llama.cpp", 3, {}, status="killed at the memory limit"),
        _row("iterserve", 4, {1: 33.0}),
        _row("llama.cpp", 4, {1: 30.0, 16: 96.0}),
    ]
    found = big_models.ratios(rows, [1, 16])
    # Round 3 has no llama.cpp figures; round 4 no iterserve batch 16.
    assert found["decode B1"]["rounds"] == pytest.approx([1.0, 1.2, 1.1])
    assert found["decode B1"]["median"] == pytest.approx(1.1)
    assert found["decode B16"]["rounds"] == pytest.approx([2.2, 2.5])
    assert found["decode B16"]["median"] == pytest.approx(2.35)
    assert "prompt B1" not in found
    assert "B1 bandwidth share" not in found  # no shares measured


def test_shares_compare_only_rounds_on_one_memory_speed(big_models: ModuleType) -> None:
    def row(engine: str, round_: int, share: float, before: float, after: float) -> dict[str, Any]:
        return _row(
            engine,
            round_,
            {1: 40.0},
            b1_bandwidth_share=share,
            bandwidth=before,
            bandwidth_after=after,
        )

    rows = [
        row("iterserve", 1, 0.90, 33e9, 34e9),
        row("llama.cpp", 1, 0.80, 32e9, 33e9),
        # Round 2: llama.cpp ran in a faster spell than iterserve.
        row("llama.cpp", 2, 0.60, 50e9, 52e9),
        row("iterserve", 2, 0.91, 33e9, 33e9),
        row("iterserve", 3, 0.80, 55e9, 52e9),
        row("llama.cpp", 3, 0.64, 54e9, 56e9),
        # Round 4: iterserve's run met a change of speed.
        row("iterserve", 4, 0.95, 33e9, 50e9),
        row("llama.cpp", 4, 0.80, 33e9, 33e9),
    ]
    found = big_models.ratios(rows, [1])
    assert found["B1 bandwidth share"]["rounds"] == pytest.approx([1.125, 1.25])
    assert found["B1 bandwidth share"]["median"] == pytest.approx(1.1875)
    assert found["decode B1"]["rounds"] == pytest.approx([1.0, 1.0, 1.0, 1.0])


def test_no_pairs_no_ratios(big_models: ModuleType) -> None:
    rows = [_row("iterserve", 1, {1: 40.0}), _row("iterserve", 2, {1: 41.0})]
    assert big_models.ratios(rows, [1]) == {}


def test_batch_one_share_is_the_median_of_its_segments(big_models: ModuleType) -> None:
    segments = [
        big_models._segment(10.0, 100.0, 30e9, 30e9),  # 10 x 2.7 GB / 30 GB/s: 0.90
        big_models._segment(12.0, 110.0, 30e9, 34e9),  # 12 x 2.7 / 32: 1.0125
        big_models._segment(9.0, 90.0, 34e9, 20e9),  # 9 x 2.7 / 27: 0.90, the memory moved
        big_models._segment(11.0, 120.0, 20e9, None),  # no reading after it: not counted
    ]
    decode, prompt = big_models._segments_median(segments)
    row = _row("llama.cpp", 1, {1: decode}, b1_segments=segments)
    big_models.add_b1_shares(row, per_step=int(2.7e9))
    assert (decode, prompt) == (10.5, 105.0)
    assert row["b1_shares"] == pytest.approx([0.90, 1.0125, 0.90])
    assert row["b1_bandwidth_share"] == pytest.approx(0.90)
    assert row["bandwidth_moved"]  # 34 and 20 GB/s around the third
    # The readings, in order: before the first segment, then after each timed one.
    assert big_models.share_readings(row) == [30e9, 30e9, 34e9, 20e9]


def test_no_timed_segment_no_share(big_models: ModuleType) -> None:
    row = _row("llama.cpp", 1, {1: 10.0}, b1_segments=[big_models._segment(10.0, 1.0, None, None)])
    big_models.add_b1_shares(row, per_step=1)
    assert "b1_bandwidth_share" not in row
    # Without timed segments the readings are those around the run, where there are any.
    assert big_models.share_readings({**row, "bandwidth": 5e9, "bandwidth_after": 6e9}) == [
        5e9,
        6e9,
    ]
