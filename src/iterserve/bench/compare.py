"""`iterserve compare`: one workload, once per batching policy, one table.

Every policy runs on the same model, KV cache, executor and metrics, on the same
seeded requests and arrival times; the only difference between rows is the
scheduler's policy. Throughput and latency stay in separate column groups.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Any

from iterserve.bench.arrivals import ArrivalSpec
from iterserve.bench.metrics import BenchMetrics, Distribution
from iterserve.bench.offline import OfflineOptions, benchmark_engine
from iterserve.bench.report import BenchReport
from iterserve.bench.workloads import Workload
from iterserve.config import EngineConfig

# A classic (unchunked) engine computes a whole prompt in one step, so its budget must
# hold the longest one; vLLM V0 used max(max_model_len, 2048) for the same reason.
_UNCHUNKED = {"enable_chunked_prefill": False, "max_num_batched_tokens": 8192}

POLICIES: dict[str, dict[str, Any]] = {
    "static": {"batching": "static", "enable_lanes": False, **_UNCHUNKED},
    "dynamic": {"batching": "dynamic", "enable_lanes": False, **_UNCHUNKED},
    "continuous+prefill-first": {
        "step_policy": "prefill-first",
        "enable_lanes": False,
        **_UNCHUNKED,
    },
    "continuous+mixed": {"step_policy": "mixed", "enable_lanes": False},
    # Interactive prefills take the budget first; documents fill the rest in chunks, with
    # a guaranteed share so they never starve.
    "continuous+mixed+lanes": {"step_policy": "mixed", "enable_lanes": True},
}


@dataclass
class PolicyRow:
    policy: str
    settings: dict[str, Any]
    report: BenchReport
    num_preemptions: int

    @property
    def metrics(self) -> BenchMetrics:
        return self.report.metrics


def policy_config(base: EngineConfig, settings: dict[str, Any]) -> EngineConfig:
    config = copy.deepcopy(base)
    for key, value in settings.items():
        setattr(config.scheduler, key, value)
    return config.validate()


def run_comparison(
    base: EngineConfig,
    workload: Workload,
    arrival: ArrivalSpec,
    policies: list[str],
    progress: bool = True,
) -> list[PolicyRow]:
    """Run `workload` once per policy; the model is loaded once and shared."""
    import torch

    from iterserve.engine.llm_engine import LLMEngine
    from iterserve.model.loader import load_model

    dtype = torch.float32 if base.dtype == "float32" else torch.bfloat16
    loaded = load_model(base.model, dtype)
    rows = []
    for name in policies:
        settings = POLICIES[name]
        engine = LLMEngine(policy_config(base, settings), loaded)
        report = benchmark_engine(
            engine,
            workload,
            arrival,
            options=OfflineOptions(progress=progress),
            label=name,
            seed=base.seed,
        )
        rows.append(PolicyRow(name, settings, report, engine.scheduler.num_preemptions))
        del engine
    return rows


def _ms(dist: Distribution | None, attr: str) -> str:
    return "-" if dist is None else f"{getattr(dist, attr):.0f}"


def format_table(rows: list[PolicyRow]) -> str:
    header = (
        f"{'policy':<26}| {'out tok/s':>9} {'req/s':>6} || {'TTFT p50':>8} {'TTFT p99':>8} "
        f"{'TBT p50':>7} {'TBT p99':>7} {'E2E p99':>8} | {'inter. TTFT p99':>15}"
    )
    lines = [
        f"{'':<26}| {'throughput':^16} || {'latency (ms)':^42} | {'interactive lane':>15}",
        header,
        "-" * len(header),
    ]
    for row in rows:
        t, lat = row.metrics.throughput, row.metrics.latency
        interactive = row.metrics.lanes.get("interactive", lat)
        lines.append(
            f"{row.policy:<26}| {t.output_throughput:>9.1f} {t.request_throughput:>6.2f} || "
            f"{_ms(lat.ttft, 'median'):>8} {_ms(lat.ttft, 'p99'):>8} "
            f"{_ms(lat.itl, 'median'):>7} {_ms(lat.itl, 'p99'):>7} {_ms(lat.e2el, 'p99'):>8} | "
            f"{_ms(interactive.ttft, 'p99'):>15}"
        )
    return "\n".join(lines)


def rows_to_json(rows: list[PolicyRow], workload: Workload, arrival: ArrivalSpec) -> dict:
    """Each policy's figures in the very shape `iterserve bench --result-json` writes (and
    a sweep point), plus what only a comparison knows: the policy and its settings."""
    return {
        "workload": workload.summary(),
        "arrivals": arrival.describe(),
        "policies": [
            {
                "policy": row.policy,
                "settings": row.settings,
                "num_preemptions": row.num_preemptions,
                **row.report.to_dict(),
            }
            for row in rows
        ],
    }


# ---- CLI -------------------------------------------------------------------------------
