"""The Grafana dashboards (deploy/grafana/dashboards) query only what exists: every metric name in a panel's or
a variable's PromQL is one the services register with prometheus_client, a recording rule of
deploy/prometheus/rules, or Prometheus' own ``up``; and they use the provisioned datasource. The same holds for the
rules' expressions."""

from __future__ import annotations

import importlib
import json
import pkgutil
import re
from pathlib import Path
from typing import Any

import pytest
import yaml
from prometheus_client import REGISTRY

REPO = Path(__file__).resolve().parents[2]
DASHBOARDS = REPO / "deploy" / "grafana" / "dashboards"
RULES = REPO / "deploy" / "prometheus" / "rules"
DATASOURCES = REPO / "deploy" / "grafana" / "provisioning" / "datasources" / "prometheus.yaml"
SERVICES = ("trainyard_api", "trainyard_scheduler", "trainyard_checkpoint_coordinator", "trainyard_registry",
            "trainyard_node_agent", "trainyard_runtime")
EXPECTED = {"job.json", "cluster.json", "goodput.json"}

_KEYWORDS = {"by", "without", "on", "ignoring", "group_left", "group_right", "and", "or", "unless", "bool",
             "offset", "inf", "nan"}
_SUFFIXES = {"counter": ("_total", "_created"), "histogram": ("_bucket", "_sum", "_count", "_created"),
             "summary": ("_sum", "_count", "_created"), "gauge": ("",), "info": ("_info",), "stateset": ("",),
             "gaugehistogram": ("_bucket", "_gsum", "_gcount"), "unknown": ("",)}


def metric_names(expr: str) -> set[str]:
    """The metric (or recording rule) names an expression reads, crudely: strings, label matchers, range and
    grouping clauses dropped; what is left that is a name and not a function call or keyword."""
    expr = re.sub(r'"(?:[^"\\]|\\.)*"', '""', expr)
    expr = re.sub(r"\{[^}]*\}", " ", expr)
    expr = re.sub(r"\[[^\]]*\]", " ", expr)
    expr = re.sub(r"\b(by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)", " ", expr)
    expr = re.sub(r"\$\w+|\$\{[^}]*\}", " ", expr)  # dashboard variables
    names = set()
    for match in re.finditer(r"(?<![\w.])([a-zA-Z_:][\w:]*)(\s*\()?", expr):
        name, call = match.group(1), match.group(2)
        if not call and name.lower() not in _KEYWORDS:
            names.add(name)
    return names


def registered() -> set[str]:
    """Every sample name the services' modules register (each module imported, so each metric is defined)."""
    for package in SERVICES:
        root = importlib.import_module(package)
        for info in pkgutil.walk_packages(root.__path__, prefix=f"{package}."):
            if not info.name.endswith("__main__"):
                importlib.import_module(info.name)
    names = set()
    for family in REGISTRY.collect():
        names.update(family.name + s for s in _SUFFIXES.get(family.type, ("",)))
    return names


def recording_rules() -> set[str]:
    out = set()
    for path in RULES.glob("*.yml"):
        for group in yaml.safe_load(path.read_text())["groups"]:
            out.update(r["record"] for r in group["rules"] if "record" in r)
    return out


def expressions(dashboard: dict[str, Any]) -> list[tuple[str, str]]:
    out = [(f"panel {p['title']!r}", t["expr"]) for p in dashboard["panels"] for t in p.get("targets", [])]
    for var in dashboard.get("templating", {}).get("list", []):
        query = var.get("query")
        query = query.get("query") if isinstance(query, dict) else query
        inner = re.fullmatch(r"label_values\((.*),\s*\w+\)", query or "")
        if inner:
            out.append((f"variable {var['name']}", inner.group(1)))
    return out


@pytest.fixture(scope="module")
def known() -> set[str]:
    return registered() | recording_rules() | {"up"}


def test_the_three_dashboards_exist() -> None:
    assert {p.name for p in DASHBOARDS.glob("*.json")} == EXPECTED


def test_metric_names_parse() -> None:
    assert metric_names('sum by (tenant) (rate(a_total{x="y(z)"}[5m])) / ignoring(kind) b:c:d > 0.5') == {
        "a_total", "b:c:d"}
    assert metric_names('histogram_quantile(0.95, sum by (le) (rate(h_bucket[5m])))') == {"h_bucket"}
    assert metric_names('m{tenant=~"$tenant", job_id=~"$job_id"} * on(job_id) group_left n') == {"m", "n"}


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_every_query_names_what_exists(name: str, known: set[str]) -> None:
    dashboard = json.loads((DASHBOARDS / name).read_text())
    exprs = expressions(dashboard)
    assert exprs, name
    for where, expr in exprs:
        names = metric_names(expr)
        assert names, f"{name} {where}: no metric in {expr!r}"
        assert names <= known, f"{name} {where}: {sorted(names - known)} is neither registered nor recorded"


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_dashboard_is_provisionable(name: str) -> None:
    uid = yaml.safe_load(DATASOURCES.read_text())["datasources"][0]["uid"]
    dashboard = json.loads((DASHBOARDS / name).read_text())
    assert dashboard["uid"] and dashboard["title"] and dashboard["panels"]
    ids = [p["id"] for p in dashboard["panels"]]
    assert len(ids) == len(set(ids)), "panel ids must be unique"
    for panel in dashboard["panels"]:
        assert panel["datasource"]["uid"] == uid, panel["title"]
        assert all(t["datasource"]["uid"] == uid for t in panel["targets"]), panel["title"]


def test_rules_read_what_exists(known: set[str]) -> None:
    """The recording and alerting rules too (an alert on a metric nobody exports would never fire)."""
    for path in RULES.glob("*.yml"):
        for group in yaml.safe_load(path.read_text())["groups"]:
            for rule in group["rules"]:
                names = metric_names(rule["expr"])
                assert names and names <= known, f"{rule.get('record') or rule['alert']}: {sorted(names - known)}"
