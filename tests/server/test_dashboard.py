"""The Grafana dashboard (deploy/grafana/iterserve.json) against what /metrics exports."""

from __future__ import annotations

import json
import re
from pathlib import Path

import httpx

from server_fixtures import running_server

DASHBOARD = Path(__file__).resolve().parents[2] / "deploy" / "grafana" / "iterserve.json"
_METRIC = re.compile(r"iterserve:[A-Za-z0-9_:]+")
# The sample names each Prometheus metric type exposes, from the name on its `# TYPE` line
# (prometheus_client writes a counter's there with its `_total`).
_SUFFIXES = {
    "counter": ("",),
    "histogram": ("_bucket", "_sum", "_count"),
    "gauge": ("",),
    "untyped": ("",),
}


def _queries(dashboard: dict) -> list[str]:
    queries = [t["expr"] for panel in dashboard["panels"] for t in panel["targets"]]
    return queries + [v["definition"] for v in dashboard["templating"]["list"] if "definition" in v]


def _exported(text: str) -> set[str]:
    """Every sample name /metrics can carry, read off its `# TYPE` lines (a labelled series
    shows no sample until its first label value, but its family is always declared)."""
    names = set()
    for line in text.splitlines():
        if line.startswith("# TYPE "):
            _, _, family, kind = line.split()
            names.update(family + suffix for suffix in _SUFFIXES[kind])
    return names


def test_every_dashboard_query_names_a_metric_the_server_exports(tiny_llama_dir: Path) -> None:
    dashboard = json.loads(DASHBOARD.read_text())
    queried = {name for query in _queries(dashboard) for name in _METRIC.findall(query)}
    assert len(queried) >= 20, sorted(queried)  # the pattern found the dashboard's metrics
    with running_server(tiny_llama_dir) as server:
        text = httpx.get(f"{server.base_url}/metrics").text
    exported = _exported(text)
    assert "iterserve:time_to_first_token_seconds_bucket" in exported
    assert queried - exported == set()


def test_dashboard_panels_are_laid_out_and_cover_the_issue_list() -> None:
    dashboard = json.loads(DASHBOARD.read_text())
    panels = dashboard["panels"]
    assert len({p["id"] for p in panels}) == len(panels)
    cells = {(p["gridPos"]["x"], p["gridPos"]["y"]) for p in panels}
    assert len(cells) == len(panels)  # no two panels on one spot
    text = " ".join(_queries(dashboard))
    for needed in (
        "requests_finished",  # request rate
        "time_to_first_token_seconds_bucket",
        "inter_token_latency_seconds_bucket",
        "num_requests_waiting",  # queue depth per lane
        "kv_cache_usage_perc",
        "prefix_cache_hits",
        "spec_decode_num_accepted_tokens",
    ):
        assert f"iterserve:{needed}" in text, needed
    # Per server (Prometheus' instance label, selectable) and in total.
    assert "by (instance" in text and 'instance=~"$instance"' in text
    # Per data-parallel replica too (selectable), never counting the fleet's own
    # replica="all" series in a sum.
    assert "by (instance, replica" in text and 'replica=~"$replica"' in text
    for query in _queries(dashboard):
        if "replica=~" in query or "replica_up" in query:
            assert query.count('replica!="all"') == query.count("iterserve:"), query
