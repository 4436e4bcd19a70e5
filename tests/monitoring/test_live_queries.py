"""Every dashboard query and every alert of the chart, run by a real Prometheus against a real
``lorafleet up`` stack: no query reads a metric that no process exports, every query parses, a
dashboard query that reads only series Prometheus holds returns data, and every alert's selectors
match the series the processes export with the labels the chart's ServiceMonitor gives them
(namespace, pod, job = component)."""

from __future__ import annotations

import json
import re
import subprocess
import time
import urllib.error
import urllib.parse
import urllib.request
from pathlib import Path

import pytest
import yaml

from benchmarks.processes import free_port, scrape
from cli.up.child_process import stop_process
from tests import test_cli
from tests.monitoring.prometheus import NAMESPACE, REPO, prometheus_binaries, render_rules

DASHBOARD = REPO / "helm/lorafleet/dashboards/lorafleet.json"
# Grafana's variables as a user viewing every pod of the release would have them.
VARIABLES = {"$namespace": NAMESPACE, "$pod": ".*", "$__rate_interval": "30s"}
# The scrape jobs as the ServiceMonitor names them (jobLabel: app.kubernetes.io/component).
JOBS = {"control-plane": "--control-plane-metrics-port", "data-plane": "--pod-metrics-port",
        "router": "--router-metrics-port"}
REQUESTS = 3  # through the router, so that its and the pod's histograms have samples
METRIC_RE = re.compile(r"\blorafleet_[a-z0-9_]+")
SELECTOR_RE = re.compile(r"\b(lorafleet_[a-z0-9_]+|up)\{([^}]*)\}")
MATCHER_RE = re.compile(r'([a-zA-Z_][a-zA-Z0-9_]*)\s*(=~|!~|!=|=)\s*"((?:[^"\\]|\\.)*)"')
TARGET_LABELS = {"namespace", "pod", "job", "instance"}
# An alert's comparison with its threshold, at the end of the expression or before an "or".
THRESHOLD_RE = re.compile(r"\s*(==|!=|>=|<=|>|<)\s*[0-9.]+(?=\s*(?:$|or\b))")

up = test_cli.up  # the `lorafleet up` stack of tests/test_cli.py, started again for this module


class Prometheus:
    """A Prometheus server on a free loopback port, a temporary data directory, scraping every second."""

    def __init__(self, binary: Path, workdir: Path, targets: dict[str, int]) -> None:
        self.port = free_port()
        rules = workdir / "lorafleet.rules.yaml"
        self.rules = render_rules(rules)
        config = {
            "global": {"scrape_interval": "1s", "scrape_timeout": "1s", "evaluation_interval": "1s"},
            "rule_files": [str(rules)],
            "scrape_configs": [
                {"job_name": job, "static_configs": [{"targets": [f"127.0.0.1:{port}"],
                                                      "labels": {"namespace": NAMESPACE, "pod": f"lorafleet-{job}-0"}}]}
                for job, port in targets.items()],
        }
        (workdir / "prometheus.yml").write_text(yaml.safe_dump(config))
        self.log = (workdir / "prometheus.log").open("w")
        self.proc = subprocess.Popen(
            [str(binary), f"--config.file={workdir / 'prometheus.yml'}", f"--storage.tsdb.path={workdir / 'data'}",
             f"--web.listen-address=127.0.0.1:{self.port}"], stdout=self.log, stderr=subprocess.STDOUT)
        self.targets = targets
        self.exported: set[str] = set()  # series names the processes export or declare (read_names)
        self.stored: set[str] = set()  # series names Prometheus holds samples of (read_names)

    def read_names(self) -> None:
        self.exported = set().union(*(_exported(scrape(port)) for port in self.targets.values()))
        self.stored = set(self.get("/api/v1/label/__name__/values")["data"])

    def get(self, path: str, **params: str) -> dict:
        url = f"http://127.0.0.1:{self.port}{path}?{urllib.parse.urlencode(params)}"
        try:
            with urllib.request.urlopen(url, timeout=10) as r:
                return json.load(r)
        except urllib.error.HTTPError as e:  # a bad query is a 400 with the reason in its body
            return json.load(e)

    def query(self, expr: str) -> list[dict]:
        """The instant vector ``expr`` returns; fails the test when Prometheus rejects it."""
        reply = self.get("/api/v1/query", query=expr)
        assert reply["status"] == "success", f"Prometheus rejects {expr!r}: {reply.get('error')}"
        return reply["data"]["result"]

    def wait_until(self, what: str, ready, timeout_s: float = 60) -> None:
        deadline = time.monotonic() + timeout_s
        while not ready():
            assert self.proc.poll() is None, f"prometheus exited: {Path(self.log.name).read_text()[-2000:]}"
            assert time.monotonic() < deadline, f"{what} not within {timeout_s} s"
            time.sleep(0.5)

    def stop(self) -> None:
        stop_process(self.proc, timeout_s=20)
        self.log.close()


def _ready(prom: Prometheus) -> bool:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{prom.port}/-/ready", timeout=2) as r:
            return r.status == 200
    except OSError:
        return False


def _exported(text: str) -> set[str]:
    """Every series name a process's /metrics text exports or declares (a labelled counter that has not
    counted yet is declared by its TYPE line only)."""
    suffixes = {"counter": ("_total", "_created"), "histogram": ("_bucket", "_sum", "_count", "_created"),
                "gauge": ("",), "summary": ("_sum", "_count", "_created")}
    names = {line.split("{")[0].split(" ")[0] for line in text.splitlines() if line and not line.startswith("#")}
    for name, kind in re.findall(r"^# TYPE (\S+) (\S+)$", text, re.MULTILINE):
        name = name.removesuffix("_total") if kind == "counter" else name  # a counter without samples keeps it
        names |= {name + s for s in suffixes.get(kind, ("",))}
    return names


@pytest.fixture(scope="module")
def prometheus(up, tmp_path_factory):
    binary, _ = prometheus_binaries()
    ports = {job: int(up.args[up.args.index(flag) + 1]) for job, flag in JOBS.items()}
    prom = Prometheus(binary, tmp_path_factory.mktemp("prometheus"), ports)
    try:
        prom.wait_until("Prometheus ready", lambda: _ready(prom))
        prom.wait_until("every target scraped", lambda: len(prom.query(f'up{{namespace="{NAMESPACE}"}} == 1')) == 3)
        for i in range(REQUESTS):
            body = json.dumps({"model": "pirate", "max_tokens": 8,
                               "messages": [{"role": "user", "content": f"Where is treasure number {i}?"}]})
            request = urllib.request.Request(f"http://127.0.0.1:{up.router_http_port}/v1/chat/completions",
                                             data=body.encode(), headers={"Content-Type": "application/json"})
            with urllib.request.urlopen(request, timeout=120) as r:
                assert r.status == 200
        total = f'sum(lorafleet_router_requests_total{{namespace="{NAMESPACE}", outcome="OK"}})'
        prom.wait_until("the requests scraped",
                        lambda: any(float(s["value"][1]) >= REQUESTS for s in prom.query(total)))
        time.sleep(3)  # a few more scrapes, so that each rate has two samples after the requests
        prom.read_names()
        yield prom
    finally:
        prom.stop()


def _dashboard_queries() -> list[tuple[str, str]]:
    dash = json.loads(DASHBOARD.read_text())
    queries = [(f"variable {v['name']}", re.sub(r"^label_values\((.*), \w+\)$", r"\1", v["query"]["query"]))
               for v in dash["templating"]["list"] if v["type"] == "query"]
    queries += [(f"panel {p['title']!r} {t['refId']}", t["expr"]) for p in dash["panels"] for t in p.get("targets", [])]
    for name, value in VARIABLES.items():
        queries = [(where, expr.replace(name, value)) for where, expr in queries]
    return queries


def _alerts(prom: Prometheus) -> list[tuple[str, str]]:
    return [(r["alert"], r["expr"]) for g in prom.rules["groups"] for r in g["rules"] if "alert" in r]


def _unexported(expr: str, prom: Prometheus) -> list[str]:
    return sorted({n for n in METRIC_RE.findall(expr) if n not in prom.exported})


def test_no_dashboard_or_alert_query_reads_a_metric_no_process_exports(prometheus):
    unknown = {where: _unexported(expr, prometheus) for where, expr in _dashboard_queries() + _alerts(prometheus)}
    assert {where: names for where, names in unknown.items() if names} == {}


def test_every_dashboard_query_returns_data_unless_it_reads_a_series_no_event_has_made_yet(prometheus):
    empty, waiting = [], []
    for where, expr in _dashboard_queries():
        if prometheus.query(expr):
            continue
        unstored = sorted({n for n in METRIC_RE.findall(expr) if n not in prometheus.stored})
        # e.g. retries by code: exported (declared), but no refusal has happened to count
        (waiting if unstored else empty).append((where, expr, unstored))
    assert empty == [], "queries of stored series that return nothing (their label matchers select none)"
    assert len(waiting) <= len(_dashboard_queries()) // 4, f"too few queries had data to check: {waiting}"


def test_every_alert_s_expression_returns_data_below_its_threshold(prometheus):
    """An alert is quiet on a healthy stack; the quantity it compares with its threshold is not empty, unless
    a selector of it waits for a label value no event has made yet (a refused request, say)."""
    for alert, expr in _alerts(prometheus):
        quantity = THRESHOLD_RE.sub("", expr)
        if prometheus.query(quantity):
            continue
        unseen = [f"{name}{{{m}}}" for name, m in SELECTOR_RE.findall(quantity)
                  if not prometheus.query(f"{name}{{{m}}}")]
        assert unseen, f"{alert}: {quantity!r} returns nothing though each of its selectors has series"


def test_every_alert_parses_and_its_selectors_match_the_exported_series(prometheus):
    for alert, expr in _alerts(prometheus):
        prometheus.query(expr)  # parses and evaluates
        for name, matchers in SELECTOR_RE.findall(expr):
            assert name == "up" or name in prometheus.exported, f"{alert}: {name} is not exported"
            if name != "up" and name not in prometheus.stored:
                continue  # declared, not counted yet (no such event): its labels cannot be seen
            parsed = MATCHER_RE.findall(matchers)
            targets = ", ".join(f'{label}{op}"{value}"' for label, op, value in parsed if label in TARGET_LABELS)
            series = prometheus.query(f"{name}{{{targets}}}")
            assert series, f"{alert}: {name}{{{targets}}} selects none of the release's series"
            labels = set().union(*(s["metric"] for s in series))
            assert {label for label, _, _ in parsed} <= labels, \
                f"{alert}: {name}{{{matchers}}} matches on labels its series lack ({sorted(labels)})"


def test_the_target_down_alert_sees_every_component_and_a_healthy_stack_raises_no_alert(prometheus):
    targets = prometheus.query(next(expr for alert, expr in _alerts(prometheus)
                                    if alert == "LorafleetTargetDown").removesuffix(" == 0"))
    assert sorted(s["metric"]["job"] for s in targets) == sorted(JOBS)
    def rules() -> list[dict]:
        return [r for g in prometheus.get("/api/v1/rules")["data"]["groups"] for r in g["rules"]]

    prometheus.wait_until("every rule evaluated",
                          lambda: all(not r.get("lastEvaluation", "0001").startswith("0001") for r in rules()))
    rules = rules()
    assert sorted(r["name"] for r in rules) == sorted(alert for alert, _ in _alerts(prometheus))
    assert [(r["name"], r.get("lastError")) for r in rules if r["health"] != "ok"] == []
    assert [(r["name"], r["state"]) for r in rules if r["state"] != "inactive"] == []
