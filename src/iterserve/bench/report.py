"""A run's report: a throughput block and a latency block, printed apart and written as JSON.

JSON keys follow `vllm bench serve` where the two overlap (`request_throughput`,
`output_throughput`, `mean_ttft_ms`, `p99_itl_ms`, ...), so scripts written for its result
files read ours; the blocks are nested so nobody mistakes one for the other.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from iterserve.bench.metrics import BenchMetrics, Distribution, LatencyBlock, ThroughputBlock
from iterserve.bench.records import RequestRecord

_LATENCY_LABELS = {
    "ttft": "TTFT",
    "itl": "TBT (ITL)",
    "tpot": "TPOT",
    "e2el": "E2E",
    "queue": "Queue time",
}
_WIDTH = 56


@dataclass
class PeerResult:
    """The same workload through another engine in the same run (throughput only)."""

    name: str  # e.g. "transformers generate, static batching"
    batch_size: int
    throughput: ThroughputBlock
    probes: dict[int, float] = field(default_factory=dict)  # batch size -> output tok/s


@dataclass
class BenchReport:
    label: str  # what was measured, e.g. "iterserve offline (continuous)"
    backend: str  # "serve" (HTTP client) or "offline" (in-process engine)
    target: str  # base URL, or the model path
    workload: dict[str, Any]
    arrivals: str
    metrics: BenchMetrics
    engine_config: dict[str, Any] | None = None
    peer: PeerResult | None = None
    notes: list[str] = field(default_factory=list)
    records: list[RequestRecord] = field(default_factory=list)

    @property
    def peer_ratio(self) -> float | None:
        """Our output tok/s over the peer's."""
        if self.peer is None or self.peer.throughput.output_throughput <= 0:
            return None
        return self.metrics.throughput.output_throughput / self.peer.throughput.output_throughput

    def to_dict(self, include_records: bool = False) -> dict[str, Any]:
        m = self.metrics
        out: dict[str, Any] = {
            "label": self.label,
            "backend": self.backend,
            "target": self.target,
            "workload": self.workload,
            "arrivals": self.arrivals,
            "throughput": asdict(m.throughput),
            "latency": latency_dict(m.latency),
            "goodput": asdict(m.goodput) if m.goodput else None,
            "prefix_cache_hit_rate": m.prefix_cache_hit_rate,
            "spec_acceptance_rate": m.spec_acceptance_rate,
            "lanes": {lane: latency_dict(block) for lane, block in m.lanes.items()},
            "failure_reasons": m.failure_reasons,
            # Every failed request's error, kept whether or not records are saved.
            "failures": [
                {"request_id": r.request_id, "error": r.error}
                for r in self.records
                if not r.success
            ],
            "engine_config": self.engine_config,
            "notes": self.notes,
        }
        if self.peer is not None:
            out["peer"] = asdict(self.peer) | {"output_throughput_ratio": self.peer_ratio}
        if include_records:
            out["records"] = [
                asdict(r) | {"token_times": list(r.token_times)} for r in self.records
            ]
        return out

    def save(self, path: str | Path, include_records: bool = False) -> None:
        Path(path).write_text(json.dumps(self.to_dict(include_records), indent=2) + "\n")


def latency_dict(block: LatencyBlock) -> dict[str, float | None]:
    """{"mean_ttft_ms": .., "median_ttft_ms": .., "p90_ttft_ms": .., ...} (vLLM's names)."""
    out: dict[str, float | None] = {}
    for name, dist in block.items():
        for stat in ("mean", "std", "median", "p90", "p99"):
            out[f"{stat}_{name}_ms"] = getattr(dist, stat) if dist else None
    return out


# ---- text ------------------------------------------------------------------------------


def _title(text: str, fill: str = "-") -> str:
    return f" {text} ".center(_WIDTH, fill)


def _row(name: str, value: Any) -> str:
    if isinstance(value, float):
        value = f"{value:.2f}"
    return f"{name:<40}{value!s:>16}"


def format_throughput(block: ThroughputBlock, metrics: BenchMetrics | None = None) -> list[str]:
    lines = [
        _title("Throughput"),
        _row("Successful requests:", block.completed),
        _row("Failed requests:", block.failed),
    ]
    if metrics is not None:
        # Distinct reasons with counts: "2 failed" says nothing about what to fix.
        lines += [
            f"  {count} x {reason[:100]}" for reason, count in metrics.failure_reasons.items()
        ]
    lines += [
        _row("Benchmark duration (s):", block.duration),
        _row("Total input tokens:", block.total_input_tokens),
        _row("Total generated tokens:", block.total_output_tokens),
        _row("Request throughput (req/s):", block.request_throughput),
    ]
    if metrics is not None and metrics.goodput is not None:
        g = metrics.goodput
        lines.append(_row("Request goodput (req/s):", g.request_goodput))
        lines.append(f"  SLOs {g.description}: {g.num_met}/{block.completed} requests met all")
    lines += [
        _row("Input token throughput (tok/s):", block.input_throughput),
        _row("Output token throughput (tok/s):", block.output_throughput),
        _row("Peak output token throughput (tok/s):", block.max_output_tokens_per_s),
        _row("Total token throughput (tok/s):", block.total_token_throughput),
        _row("Max concurrent requests:", block.max_concurrent_requests),
    ]
    if metrics is not None and metrics.prefix_cache_hit_rate is not None:
        lines.append(_row("Prefix cache hit rate:", f"{metrics.prefix_cache_hit_rate:.1%}"))
    if metrics is not None and metrics.spec_acceptance_rate is not None:
        lines.append(_row("Draft acceptance rate:", f"{metrics.spec_acceptance_rate:.1%}"))
    return lines


def format_latency(block: LatencyBlock, title: str = "Latency") -> list[str]:
    lines = [_title(title), f"{'(ms)':<16}{'mean':>10}{'p50':>10}{'p90':>10}{'p99':>10}"]
    for name, dist in block.items():
        label = _LATENCY_LABELS[name]
        if dist is None:
            why = "not visible to a client" if name == "queue" else "no samples"
            lines.append(f"{label:<16}{'n/a':>10}  ({why})")
        else:
            lines.append(f"{label:<16}" + "".join(f"{v:>10.1f}" for v in _stats(dist)))
    return lines


def _stats(dist: Distribution) -> tuple[float, float, float, float]:
    return dist.mean, dist.median, dist.p90, dist.p99


def format_peer(report: BenchReport) -> list[str]:
    peer = report.peer
    if peer is None:
        return []
    block = peer.throughput
    lines = [
        _title(f"Peer: {peer.name}"),
        _row("Batch size (best of probes):", peer.batch_size),
    ]
    if peer.probes:
        probes = ", ".join(f"{b}: {v:.0f}" for b, v in sorted(peer.probes.items()))
        lines.append(f"  probe output tok/s by batch size: {probes}")
    lines += [
        _row("Benchmark duration (s):", block.duration),
        _row("Request throughput (req/s):", block.request_throughput),
        _row("Output token throughput (tok/s):", block.output_throughput),
        _row("Total token throughput (tok/s):", block.total_token_throughput),
    ]
    if report.peer_ratio is not None:
        lines.append(_row("iterserve / peer, output tok/s:", f"{report.peer_ratio:.2f}x"))
    return lines


def format_report(report: BenchReport) -> str:
    w = report.workload
    lines = [
        _title(f"Benchmark: {report.label}", "="),
        f"Target:    {report.target}",
        f"Workload:  {w['name']}, {w['num_requests']} requests, mean prompt "
        f"{w['mean_prompt_len']:.1f} tok, mean output {w['mean_output_len']:.1f} tok",
        f"Arrivals:  {report.arrivals}",
        *format_throughput(report.metrics.throughput, report.metrics),
        *format_latency(report.metrics.latency),
    ]
    for lane, block in report.metrics.lanes.items():
        lines += format_latency(block, f"Latency, {lane} lane")
    lines += format_peer(report)
    lines += [f"note: {note}" for note in report.notes]
    lines.append("=" * _WIDTH)
    return "\n".join(lines)
