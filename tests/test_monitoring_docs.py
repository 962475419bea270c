"""The Grafana dashboard and the alert rules in docs/ name only metrics we export."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import yaml

pytest.importorskip("prometheus_client", reason="prometheus_client is not installed")
from prometheus_client import CollectorRegistry, generate_latest

from django_dlock import lock
from django_dlock.contrib import prometheus

DOCS = Path(__file__).resolve().parent.parent / "docs"
METRIC = re.compile(r"\bdlock_[a-z_]+")


def exported() -> set[str]:
    """Every series name the metrics expose once each has been touched."""
    metrics = prometheus.install(registry=CollectorRegistry())
    try:
        with lock("docs-metrics:1", backend="locmem"):
            pass
        text = generate_latest(metrics.registry).decode()
    finally:
        prometheus.uninstall()
    names = set(re.findall(r"^# TYPE (\w+)", text, re.M))
    for name in list(names):
        names |= {name + s for s in ("_total", "_bucket", "_count", "_sum")}
    return names


def test_the_dashboard_queries_exported_metrics() -> None:
    dashboard = json.loads((DOCS / "grafana" / "django-dlock.json").read_text())
    exprs = [t["expr"] for p in dashboard["panels"] for t in p["targets"]]
    assert len(exprs) >= 8
    used = {m for e in exprs for m in METRIC.findall(e)}
    assert used - exported() == set()
    # Every metric of the table in docs/monitoring.md is on the dashboard.
    table = set(re.findall(r"^\| `(dlock_\w+)`", (DOCS / "monitoring.md").read_text(), re.M))
    assert len(table) == 12
    assert {m.removesuffix("_total") for m in table} <= {
        re.sub(r"_(total|bucket)$", "", m) for m in used
    }


def test_the_alert_rules_use_exported_metrics() -> None:
    rules = yaml.safe_load((DOCS / "prometheus" / "django-dlock-alerts.yml").read_text())
    (group,) = rules["groups"]
    alerts = {r["alert"]: r for r in group["rules"]}
    assert set(alerts) == {
        "DlockLeaseLost", "DlockWatchdogLagging", "DlockWaitOverSLO", "DlockTimeouts"
    }  # fmt: skip
    used = {m for r in alerts.values() for m in METRIC.findall(r["expr"])}
    assert used and used - exported() == set()
