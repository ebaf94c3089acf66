"""The Grafana dashboard covers what the issue asks for and queries only metrics that the
operator's and the trainer's metrics modules really define (tests/integration/chart runs every
query against a real Prometheus)."""

from __future__ import annotations

import importlib
import json
import re
from typing import Any

import pytest

from tests.unit.chart.chartlib import CHART

DASHBOARD = json.loads((CHART / "files" / "dashboards" / "elastrain.json").read_text())
METRIC = re.compile(r"\belastrain_(?:operator|trainer)_[a-zA-Z0-9_]+")
# The topics the dashboard must show, each matched against panel titles.
TOPICS = ["jobs by phase", "workers desired / ready", "step rate", "loss", "tokens / s",
          "checkpoint age", "checkpoint save / load duration", "restarts", "preemptions",
          "recovery time"]


def panels() -> list[dict[str, Any]]:
    return [p for p in DASHBOARD["panels"] if p["type"] != "row"]


def queries() -> list[str]:
    return [t["expr"] for p in panels() for t in p["targets"]]


def sample_names(module_name: str) -> set[str]:
    """Every sample name a metrics module can expose (labelled metrics without children too)."""
    module = importlib.import_module(module_name)
    registry = getattr(module, "REGISTRY", None)
    if registry is None:
        from prometheus_client import REGISTRY as registry
    suffixes = {"counter": ["_total", "_created"], "histogram": ["_bucket", "_count", "_sum"],
                "summary": ["_count", "_sum"], "gauge": [""], "info": ["_info"],
                "stateset": [""], "gaugehistogram": ["_bucket", "_gcount", "_gsum"],
                "unknown": [""]}
    return {family.name + suffix for family in registry.collect()
            for suffix in suffixes[family.type]}


def test_dashboard_covers_every_topic() -> None:
    titles = [p["title"].lower() for p in panels()]
    missing = [t for t in TOPICS if not any(t in title for title in titles)]
    assert not missing


def test_every_panel_queries_prometheus_through_the_datasource_variable() -> None:
    variables = {v["name"] for v in DASHBOARD["templating"]["list"]}
    assert "datasource" in variables
    for panel in panels():
        assert panel["datasource"]["uid"] == "${datasource}"
        assert panel["targets"], panel["title"]
    ids = [p["id"] for p in DASHBOARD["panels"]]
    assert len(ids) == len(set(ids))


@pytest.mark.parametrize("module", ["elastrain_operator.metrics", "elastrain_trainer.metrics"])
def test_queries_name_only_metrics_the_modules_define(module: str) -> None:
    prefix = "elastrain_operator_" if "operator" in module else "elastrain_trainer_"
    try:
        defined = sample_names(module)
    except ModuleNotFoundError:
        pytest.fail(f"{module} does not exist yet")
    used = {name for expr in queries() for name in METRIC.findall(expr)
            if name.startswith(prefix)}
    assert used, f"the dashboard shows nothing from {module}"
    assert used <= defined, f"undefined metrics: {sorted(used - defined)}"
