"""The throughput-latency curve: one full run per load level, one curve per configuration.

Load is swept along one axis: request rate (open loop), concurrency (closed loop) or the
engine's max_num_seqs. Configurations are the cross product of the engine settings given as
lists (`--batching continuous,static`, `--prefix-caching on,off`, ...): each becomes a curve,
so the effect of a feature is the gap between two curves on one chart.

Points run through a backend: in-process engines (one per configuration, prefix cache reset
between points), or iterserve servers launched per configuration, or one server already
running at a URL (load axes only: its settings are not ours to change).
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import math
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from iterserve.bench.arrivals import ArrivalSpec
from iterserve.bench.report import BenchReport
from iterserve.config import EngineConfig

SWEEP_AXES = ("request_rate", "max_concurrency", "max_num_seqs")

# Sweepable engine settings: CLI name -> (section, field, value parser).
_ON_OFF = {"on": True, "off": False, "true": True, "false": False}
CONFIG_AXES: dict[str, tuple[str, str, Callable[[str], Any]]] = {
    "batching": ("scheduler", "batching", str),
    "prefix_caching": ("cache", "enable_prefix_caching", lambda v: _ON_OFF[v.lower()]),
    "chunked_prefill": ("scheduler", "enable_chunked_prefill", lambda v: _ON_OFF[v.lower()]),
    "step_policy": ("scheduler", "step_policy", str),
    "max_num_seqs": ("scheduler", "max_num_seqs", int),
}


@dataclass
class Variant:
    """One configuration, i.e. one curve: a label and the settings it changes."""

    label: str
    overrides: dict[str, Any] = field(default_factory=dict)  # "section.field" -> value

    def apply(self, base: EngineConfig) -> EngineConfig:
        config = dataclasses.replace(
            base,
            cache=dataclasses.replace(base.cache),
            scheduler=dataclasses.replace(base.scheduler),
        )
        for path, value in self.overrides.items():
            section, name = path.split(".")
            setattr(getattr(config, section), name, value)
        return config.validate()


def variants_from(lists: dict[str, list[str]]) -> list[Variant]:
    """{"batching": ["continuous", "static"], "prefix_caching": ["on"]} -> one Variant each.

    Settings given a single value apply to every curve and stay out of the labels.
    """
    for name in lists:
        if name not in CONFIG_AXES:
            raise ValueError(f"cannot sweep {name!r}; can sweep {', '.join(CONFIG_AXES)}")
    names = [n for n, values in lists.items() if values]
    out = []
    for combo in itertools.product(*(lists[n] for n in names)):
        overrides = {}
        label_parts = []
        for name, raw in zip(names, combo, strict=True):
            section, attr, parse = CONFIG_AXES[name]
            try:
                overrides[f"{section}.{attr}"] = parse(raw)
            except KeyError:
                raise ValueError(f"--{name.replace('_', '-')} takes on/off, got {raw!r}") from None
            if len(lists[name]) > 1:
                label_parts.append(raw if name == "batching" else f"{name.replace('_', '-')} {raw}")
        out.append(Variant(", ".join(label_parts) or "iterserve", overrides))
    return out or [Variant("iterserve")]


@dataclass
class SweepPoint:
    label: str  # the curve
    axis: str
    value: float
    report: BenchReport


@dataclass
class SweepResult:
    axis: str
    points: list[SweepPoint]

    def curves(self) -> dict[str, list[SweepPoint]]:
        out: dict[str, list[SweepPoint]] = {}
        for point in self.points:
            out.setdefault(point.label, []).append(point)
        return {label: sorted(ps, key=lambda p: p.value) for label, ps in out.items()}

    def save(self, path: str | Path) -> None:
        data = {
            "axis": self.axis,
            "points": [
                {"label": p.label, self.axis: _jsonable(p.value), **p.report.to_dict()}
                for p in self.points
            ],
        }
        Path(path).write_text(json.dumps(data, indent=2) + "\n")


def _jsonable(value: float) -> float | str:
    return "inf" if math.isinf(value) else value


def point_arrival(base: ArrivalSpec, axis: str, value: float) -> ArrivalSpec:
    """The arrival process of one point: the swept quantity set on the base process."""
    if axis == "request_rate":
        process = base.process if base.process in ("poisson", "gamma") else "poisson"
        return dataclasses.replace(base, process=process, request_rate=value)
    if axis == "max_concurrency":
        return dataclasses.replace(base, process="closed", max_concurrency=int(value))
    return base


# A backend runs one point: (engine config, arrival, label) -> report.
RunPoint = Callable[[EngineConfig, ArrivalSpec, str], BenchReport]


def run_sweep(
    base_config: EngineConfig,
    variants: list[Variant],
    axis: str,
    values: list[float],
    base_arrival: ArrivalSpec,
    run_point: RunPoint,
    on_point: Callable[[SweepPoint], None] | None = None,
) -> SweepResult:
    """Every (variant, value) pair, grouped by variant so a backend reuses its engine."""
    if axis not in SWEEP_AXES:
        raise ValueError(f"sweep axis must be one of {SWEEP_AXES}")
    if not values:
        raise ValueError("a sweep needs at least one value")
    points = []
    for variant in variants:
        for value in values:
            config = variant.apply(base_config)
            if axis == "max_num_seqs":
                config.scheduler.max_num_seqs = int(value)
            arrival = point_arrival(base_arrival, axis, value)
            report = run_point(config, arrival, variant.label)
            point = SweepPoint(variant.label, axis, value, report)
            points.append(point)
            if on_point is not None:
                on_point(point)
    return SweepResult(axis, points)


def format_table(result: SweepResult) -> str:
    """One row per point: load, both throughput figures and the latencies that bound them."""
    header = (
        f"{'config':<22}{result.axis:>16}{'req/s':>8}{'out tok/s':>11}"
        f"{'p50 TTFT':>10}{'p99 TTFT':>10}{'p99 TBT':>9}{'p99 TPOT':>10}{'goodput':>9}"
    )
    lines = [header, "-" * len(header)]
    for label, points in result.curves().items():
        for p in points:
            t, lat = p.report.metrics.throughput, p.report.metrics.latency

            def ms(dist: Any, stat: str) -> str:
                return f"{getattr(dist, stat):.0f}" if dist else "n/a"

            goodput = f"{t.request_goodput:.2f}" if t.request_goodput is not None else "-"
            lines.append(
                f"{label[:21]:<22}{p.value:>16g}{t.request_throughput:>8.2f}"
                f"{t.output_throughput:>11.1f}{ms(lat.ttft, 'median'):>10}"
                f"{ms(lat.ttft, 'p99'):>10}{ms(lat.itl, 'p99'):>9}{ms(lat.tpot, 'p99'):>10}"
                f"{goodput:>9}"
            )
    return "\n".join(lines)
