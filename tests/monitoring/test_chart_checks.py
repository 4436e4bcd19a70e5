"""helm/chart_checks.py's checks of the alerts and the dashboard: it refuses a rendering whose rule or
panel reads a metric no process defines, or that lacks a promised alert."""

from __future__ import annotations

import importlib.util
import json

import pytest
import yaml

from tests.monitoring.prometheus import REPO, helm_template

_spec = importlib.util.spec_from_file_location("chart_checks", REPO / "helm/chart_checks.py")
chart_checks = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(chart_checks)


@pytest.fixture(scope="module")
def rendering() -> str:
    return helm_template("--set", "metrics.prometheusRule.enabled=true", "--set", "metrics.dashboard.enabled=true")


@pytest.fixture
def rendered(rendering) -> list[dict]:
    """The chart's resources, parsed afresh for each test to change."""
    return [d for d in yaml.safe_load_all(rendering) if d]


def _errors(docs: list[dict]) -> list[str]:
    checker = chart_checks.Checker(docs)
    checker.check_dashboards()
    for doc in docs:
        if (doc.get("apiVersion"), doc.get("kind")) == chart_checks.PROMETHEUS_RULE:
            checker.check_prometheus_rule(doc)
    return checker.errors


def _rule(docs: list[dict]) -> dict:
    return next(d for d in docs if d["kind"] == "PrometheusRule")


def test_the_chart_s_alerts_and_dashboard_pass(rendered):
    assert _errors(rendered) == []


def test_an_alert_on_a_metric_no_process_defines_is_refused(rendered):
    rule = _rule(rendered)["spec"]["groups"][0]["rules"][0]
    rule["expr"] = "rate(lorafleet_adapter_load_failures_total[5m]) > 0"
    assert any("lorafleet_adapter_load_failures_total, which no process exports" in e for e in _errors(rendered))


def test_a_missing_alert_and_one_without_severity_are_refused(rendered):
    rules = _rule(rendered)["spec"]["groups"][0]["rules"]
    dropped = rules.pop()
    del rules[0]["labels"]["severity"]
    errors = _errors(rendered)
    assert f"PrometheusRule/lorafleet: has no alert {dropped['alert']}" in errors
    assert any(f"rule {rules[0]['alert']!r}: labels.severity" in e for e in errors)


def test_a_panel_on_a_metric_no_process_defines_is_refused(rendered):
    dashboard = next(d for d in rendered if d["kind"] == "ConfigMap" and d["metadata"]["name"].endswith("dashboard"))
    dash = json.loads(dashboard["data"]["lorafleet.json"])
    dash["panels"][-1]["targets"][0]["expr"] = "sum(lorafleet_control_plane_leaders)"
    dashboard["data"]["lorafleet.json"] = json.dumps(dash)
    assert any("lorafleet_control_plane_leaders, which no process exports" in e for e in _errors(rendered))
