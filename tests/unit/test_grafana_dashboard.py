"""deploy/grafana/pdserve.json: the dashboard parses, its panels are well formed, and its
queries name exactly the metrics pdserve exports (read from pdserve/metrics.py's own
registries, so a renamed or new metric fails here until the dashboard follows)."""

import json
import re
from pathlib import Path

import pytest

from pdserve.metrics import RouterMetrics, WorkerMetrics

DASHBOARD = Path(__file__).resolve().parents[2] / "deploy" / "grafana" / "pdserve.json"
DATASOURCE = {"type": "prometheus", "uid": "${datasource}"}
METRIC = re.compile(r"pdserve_[a-z_]+")
# The sample names a family of each type exports, by suffix on the family's name
# (prometheus-client drops `_total` from a counter family's name).
SUFFIXES = {"counter": ("", "_total"), "gauge": ("",),
            "histogram": ("", "_bucket", "_sum", "_count")}


@pytest.fixture(scope="module")
def dashboard() -> dict:
    return json.loads(DASHBOARD.read_text())


@pytest.fixture(scope="module")
def exported() -> dict[str, str]:
    """{a sample name a query may use: its family's name}, over the router and a worker
    that reports every gauge and counter."""
    values = dict.fromkeys([*WorkerMetrics.GAUGES, *WorkerMetrics.COUNTERS], 0)
    registries = [RouterMetrics(waiting=lambda: 0).registry,
                  WorkerMetrics("decode", lambda: values).registry]
    return {f.name + s: f.name for r in registries for f in r.collect()
            for s in SUFFIXES[f.type]}


def panels(dashboard: dict) -> list[dict]:
    """Every panel, rows' nested ones (collapsed rows) included."""
    out = []
    for p in dashboard["panels"]:
        out += [p, *p.get("panels", [])]
    return out


def graphs(dashboard: dict) -> list[dict]:
    return [p for p in panels(dashboard) if p["type"] != "row"]


def test_dashboard_header(dashboard):
    assert dashboard["uid"] == "pdserve" and dashboard["title"] == "pdserve"
    variables = {v["name"]: v for v in dashboard["templating"]["list"]}
    assert variables["datasource"]["type"] == "datasource"
    assert variables["datasource"]["query"] == "prometheus"
    assert "instance" in variables
    assert [p["title"] for p in dashboard["panels"] if p["type"] == "row"] == [
        "Requests", "Latency", "Workers", "KV transfer"]


def test_panels_are_well_formed(dashboard):
    ids = [p["id"] for p in panels(dashboard)]
    assert len(ids) == len(set(ids)), f"duplicate panel ids: {sorted(ids)}"
    for p in graphs(dashboard):
        g = p["gridPos"]
        assert 0 <= g["x"] and g["x"] + g["w"] <= 24, f"{p['title']!r} is off the grid: {g}"
        assert p["datasource"] == DATASOURCE, p["title"]
        assert any(t.get("expr", "").strip() for t in p["targets"]), \
            f"{p['title']!r} has no query"
        for t in p["targets"]:
            assert t.get("datasource", DATASOURCE) == DATASOURCE, p["title"]


def test_queries_use_only_exported_metrics(dashboard, exported):
    queries = [t["expr"] for p in graphs(dashboard) for t in p["targets"]]
    queries += [str(v.get("query", "")) for v in dashboard["templating"]["list"]]
    unknown = {m for q in queries for m in METRIC.findall(q)} - exported.keys()
    assert not unknown, f"not exported by pdserve/metrics.py: {sorted(unknown)}"


def test_every_exported_metric_is_shown(dashboard, exported):
    shown = {exported.get(m) for p in graphs(dashboard) for t in p["targets"]
             for m in METRIC.findall(t["expr"])}
    missing = set(exported.values()) - shown
    assert not missing, f"no panel shows: {sorted(missing)}"
