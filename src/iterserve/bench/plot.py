"""The sweep as a picture: output tok/s against p99 TTFT and against p99 TBT, knee marked.

Each configuration is one curve, its points in order of offered load. The knee is the last
point before latency starts to climb faster than throughput: past it, each step of load buys
relatively less throughput than it costs in latency (elasticity d ln latency / d ln tput > 1),
which is where a server should be run at most.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from iterserve.bench.sweep import SweepResult


def find_knee(throughputs: Sequence[float], latencies: Sequence[float]) -> int | None:
    """Index of the knee in points ordered by load, or None if latency never outruns tput.

    Between neighbours i-1 and i, latency outruns throughput when its relative growth is
    larger: lat[i] / lat[i-1] > tput[i] / tput[i-1]. The knee is the point i-1 before the
    first such segment. A throughput that falls while latency rises counts as outrun too.
    """
    for i in range(1, len(throughputs)):
        t0, t1, l0, l1 = throughputs[i - 1], throughputs[i], latencies[i - 1], latencies[i]
        if l0 <= 0 or t0 <= 0 or l1 <= l0:
            continue
        if l1 / l0 > t1 / t0:
            return i - 1
    return None


def _series(points: list, metric: str) -> tuple[list[float], list[float], list[float]]:
    xs, ys, loads = [], [], []
    for point in points:
        dist = getattr(point.report.metrics.latency, metric)
        if dist is None:
            continue
        xs.append(point.report.metrics.throughput.output_throughput)
        ys.append(dist.p99)
        loads.append(point.value)
    return xs, ys, loads


def plot_sweep(result: SweepResult, path: str | Path, title: str | None = None) -> Path:
    import matplotlib

    matplotlib.use("Agg")  # files only: no display on a server or in CI
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(12, 4.8))
    panels = (("ttft", "p99 TTFT (ms)"), ("itl", "p99 TBT (ms)"))
    for ax, (metric, ylabel) in zip(axes, panels, strict=True):
        for label, points in result.curves().items():
            xs, ys, loads = _series(points, metric)
            if not xs:
                continue
            (line,) = ax.plot(xs, ys, marker="o", label=label)
            for x, y, load in zip(xs, ys, loads, strict=True):
                ax.annotate(
                    f"{load:g}", (x, y), textcoords="offset points", xytext=(4, 4), fontsize=7
                )
            knee = find_knee(xs, ys)
            if knee is not None:
                ax.scatter(
                    [xs[knee]], [ys[knee]], s=220, facecolors="none",
                    edgecolors=line.get_color(), linewidths=2, zorder=3,
                )  # fmt: skip
                ax.annotate(
                    "knee", (xs[knee], ys[knee]), textcoords="offset points", xytext=(-10, 12),
                    color=line.get_color(), fontsize=9, fontweight="bold",
                )  # fmt: skip
        ax.set_xlabel("output throughput (tok/s)")
        ax.set_ylabel(ylabel)
        ax.set_yscale("log")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=8)
    heading = title or "throughput vs latency"
    fig.suptitle(f"{heading} (point labels: {result.axis}; circled: knee)")
    fig.tight_layout()
    path = Path(path)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
