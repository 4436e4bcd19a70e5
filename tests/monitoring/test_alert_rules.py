"""The chart's alert rules under `promtool test rules`: every alert fires on series that should fire it
and stays quiet on series that should not (the cases: alert_rules_test.yaml)."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import yaml

from tests.monitoring.prometheus import alert_names, prometheus_binaries, render_rules

CASES = Path(__file__).with_name("alert_rules_test.yaml")


def test_every_alert_passes_its_promtool_unit_tests(tmp_path):
    _, promtool = prometheus_binaries()
    render_rules(tmp_path / "lorafleet.rules.yaml")
    shutil.copy(CASES, tmp_path / CASES.name)
    done = subprocess.run([str(promtool), "test", "rules", CASES.name], cwd=tmp_path, capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr


def test_every_alert_has_a_case_that_fires_it_and_one_that_does_not(tmp_path):
    alerts = alert_names(render_rules(tmp_path / "lorafleet.rules.yaml"))
    evals = [e for t in yaml.safe_load(CASES.read_text())["tests"] for e in t["alert_rule_test"]]
    fired = {e["alertname"] for e in evals if e.get("exp_alerts")}
    quiet = {e["alertname"] for e in evals if not e.get("exp_alerts")}
    assert set(alerts) - fired == set(), "alerts no case fires"
    assert set(alerts) - quiet == set(), "alerts no case keeps quiet"
    assert (fired | quiet) - set(alerts) == set(), "cases of alerts the chart does not define"


def test_thresholds_follow_the_values(tmp_path):
    spec = render_rules(tmp_path / "lorafleet.rules.yaml", "--set", "metrics.prometheusRule.ttftP99Seconds=2.5",
                        "--set", "metrics.prometheusRule.refusalRatio=0.2",
                        "--set", "metrics.prometheusRule.estimateErrorSeconds=1")
    exprs = {r["alert"]: r["expr"] for g in spec["groups"] for r in g["rules"]}
    assert exprs["LorafleetTtftOverPromise"].endswith("> 2.5")
    assert exprs["LorafleetRefusalRateHigh"].endswith("> 0.2")
    assert exprs["LorafleetTtftEstimateDrift"].endswith("> 1")
    _, promtool = prometheus_binaries()
    done = subprocess.run([str(promtool), "check", "rules", str(tmp_path / "lorafleet.rules.yaml")],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stdout + done.stderr
