"""Checks of the lorafleet chart that helm lint and kubernetes-validate do not make.

    chart_checks.py manifests RENDERED CORE_OUT
        Reads the output of `helm template`, writes every resource of a built-in Kubernetes kind to
        CORE_OUT (for `kubernetes-validate --strict`), and checks the rest itself:
        - a ServiceMonitor (monitoring.coreos.com/v1, a CRD that kubernetes-validate has no schema for)
          against the fields the Prometheus Operator defines, and that it selects a rendered Service
          with the named port, whose pods expose it;
        - every Service, PodDisruptionBudget and NetworkPolicy selector matches a rendered pod template,
          and every Service port targets a port those pods expose;
        - images are pinned, pods run as non-root, containers have resources; every container with a
          "grpc" port has gRPC startup, readiness and liveness probes on it, or on its plaintext "health"
          port when it has one (it serves TLS, which the kubelet's gRPC probes cannot speak); startup and
          readiness check the overall health (service ""), and the liveness of the control plane and the data plane
          checks their liveness service, which a Redis outage, a model load or a drain leaves SERVING;
        - only the router and the control plane may reach the data-plane pods' gRPC port (Generate);
        - a HorizontalPodAutoscaler scales a rendered workload that leaves its replicas to it;
        - the Grafana dashboard ConfigMap holds valid JSON that queries the metrics it promises;
        - a PrometheusRule (monitoring.coreos.com/v1) holds the alerts it promises, each with an expression,
          a severity and a summary, under unique names;
        - every lorafleet_* metric a dashboard query or an alert names is one the processes define (their
          metrics modules: data_plane/, control_plane/, router/metrics.py).
        Any other kind that kubernetes-validate would only warn about is an error here.

    chart_checks.py values-docs VALUES README
        Every value in values.yaml has a "# --" comment (on it or an enclosing key), and the README
        holds the values table that values-table prints.

    chart_checks.py values-table VALUES
        Prints the values table (key, default, the "# --" comment) for the chart's README.

Exit status 1 on any failure; the reasons go to stderr.
"""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

import yaml

SERVICE_MONITOR = ("monitoring.coreos.com/v1", "ServiceMonitor")
PROMETHEUS_RULE = ("monitoring.coreos.com/v1", "PrometheusRule")
CRD_KINDS = {SERVICE_MONITOR, PROMETHEUS_RULE}
WORKLOAD_KINDS = {"Deployment", "StatefulSet", "DaemonSet", "Job"}
COMPONENT = "app.kubernetes.io/component"
# The health service that is SERVING while a process is not wedged (conventions/health.py), and the
# components that report it.
LIVENESS_SERVICE = "lorafleet.liveness"
LIVENESS_COMPONENTS = {"control-plane", "data-plane"}
# The components the data-plane pods' gRPC port admits: routers (Generate, GetState) and the control plane.
POD_GRPC_PEERS = {"router", "control-plane"}
# Fields of ServiceMonitor.spec and of one endpoint, as the Prometheus Operator's CRD defines them.
SM_SPEC_FIELDS = set(
    "attachMetadata bodySizeLimit endpoints fallbackScrapeProtocol jobLabel keepDroppedTargets "
    "labelLimit labelNameLengthLimit labelValueLengthLimit namespaceSelector "
    "nativeHistogramBucketLimit nativeHistogramMinBucketFactor podTargetLabels sampleLimit "
    "scrapeClass scrapeClassicHistograms scrapeProtocols selector selectorMechanism "
    "serviceDiscoveryRole targetLabels targetLimit".split()
)
SM_ENDPOINT_FIELDS = set(
    "authorization basicAuth bearerTokenFile bearerTokenSecret enableHttp2 filterRunning "
    "followRedirects honorLabels honorTimestamps interval metricRelabelings noProxy oauth2 params "
    "path port proxyConnectHeader proxyFromEnvironment proxyUrl relabelings scheme scrapeTimeout "
    "targetPort tlsConfig trackTimestampsStaleness".split()
)
# The Prometheus duration pattern of the CRD (interval, scrapeTimeout).
DURATION_RE = re.compile(
    r"^(0|(([0-9]+)y)?(([0-9]+)w)?(([0-9]+)d)?(([0-9]+)h)?(([0-9]+)m)?(([0-9]+)s)?(([0-9]+)ms)?)$")
DNS_LABEL_RE = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$")
DASHBOARD_METRICS = (
    "lorafleet_gpu_lora_slots_used", "lorafleet_gpu_lora_slots_total", "lorafleet_gpu_lora_slots_pinned",
    "lorafleet_cpu_lora_cache_used", "lorafleet_cpu_lora_cache_capacity", "lorafleet_cpu_lora_cache_pinned",
    "lorafleet_adapter_loads_total", "lorafleet_adapter_evictions_total", "lorafleet_adapter_load_seconds_bucket",
    "lorafleet_time_to_first_token_seconds_bucket", "lorafleet_inter_token_latency_seconds_bucket",
    "lorafleet_requests_running", "lorafleet_requests_waiting", "lorafleet_kv_cache_usage_ratio",
    "lorafleet_requests_refused_total", "lorafleet_ttft_estimate_error_seconds_bucket",
    "lorafleet_router_requests_total", "lorafleet_router_time_to_first_token_seconds_bucket",
    "lorafleet_router_routing_decisions_total", "lorafleet_router_retries_total", "lorafleet_router_pods_routable",
    "lorafleet_router_state_read_failures_total",
    "lorafleet_control_plane_leader", "lorafleet_control_plane_redis_up", "lorafleet_control_plane_pods",
    "lorafleet_control_plane_pods_removed_total", "lorafleet_control_plane_pins_unsatisfied",
    "lorafleet_control_plane_pod_commands_total", "lorafleet_control_plane_rpcs_total",
    "lorafleet_control_plane_reconcile_duration_seconds_bucket",
)
# The alerts the PrometheusRule must hold (docs/operations.md, "Alerts", says what to do for each).
ALERTS = (
    "LorafleetTargetDown", "LorafleetPodLost", "LorafleetTtftOverPromise", "LorafleetRefusalRateHigh",
    "LorafleetTtftEstimateDrift", "LorafleetAdapterLoadFailures", "LorafleetRedisUnreachable",
    "LorafleetLeaderMissing", "LorafleetNoRoutablePods",
)
PR_RULE_FIELDS = {"alert", "record", "expr", "for", "keep_firing_for", "labels", "annotations"}
SEVERITIES = {"critical", "warning", "info"}
# Where each process defines its metrics, and the series names a family of each kind exports.
METRICS_MODULES = ("data_plane/metrics.py", "control_plane/metrics.py", "router/metrics.py")
METRIC_NAME_RE = re.compile(r"\blorafleet_[a-z0-9_]+")
_SUFFIXES = ("_total", "_bucket", "_sum", "_count", "_created")


def defined_metrics(root: Path) -> set[str]:
    """The metric family names the processes' metrics modules define (their string literals)."""
    names: set[str] = set()
    for module in METRICS_MODULES:
        names |= set(re.findall(r"[\"'](lorafleet_[a-z0-9_]+)[\"']", (root / module).read_text()))
    return names


def undefined_metrics(expr: str, defined: set[str]) -> list[str]:
    """The lorafleet_* series names ``expr`` reads that no defined family exports."""
    def known(name: str) -> bool:
        return name in defined or any(name.endswith(s) and name[: -len(s)] in defined for s in _SUFFIXES)
    return sorted({n for n in METRIC_NAME_RE.findall(expr) if not known(n)})


def _seconds(duration: str) -> float:
    units = {"y": 31536000, "w": 604800, "d": 86400, "h": 3600, "m": 60, "s": 1, "ms": 0.001}
    return sum(int(n) * units[u] for n, u in re.findall(r"(\d+)(ms|y|w|d|h|m|s)", duration))


def _name(doc: dict) -> str:
    return f"{doc.get('kind')}/{doc.get('metadata', {}).get('name')}"


def _selects(selector: dict, labels: dict) -> bool:
    """Whether a label selector (matchLabels/matchExpressions, or a plain map) matches labels."""
    if "matchLabels" not in selector and "matchExpressions" not in selector:
        selector = {"matchLabels": selector}
    for key, value in (selector.get("matchLabels") or {}).items():
        if labels.get(key) != value:
            return False
    for expr in selector.get("matchExpressions") or []:
        key, op, values = expr["key"], expr["operator"], expr.get("values") or []
        ok = {"In": key in labels and labels[key] in values, "NotIn": labels.get(key) not in values,
              "Exists": key in labels, "DoesNotExist": key not in labels}[op]
        if not ok:
            return False
    return True


class Checker:
    def __init__(self, docs: list[dict]):
        self.docs = docs
        self.defined = defined_metrics(Path(__file__).resolve().parent.parent)
        self.errors: list[str] = []
        self.pods = [d for d in docs if d.get("kind") in WORKLOAD_KINDS]

    def fail(self, message: str) -> None:
        self.errors.append(message)

    def pod_templates(self, namespace: str | None = None):
        for w in self.pods:
            if namespace is None or w["metadata"].get("namespace") == namespace:
                yield w, w["spec"]["template"]

    def check_selectors(self) -> None:
        for doc in self.docs:
            kind, ns = doc.get("kind"), doc.get("metadata", {}).get("namespace")
            if kind in ("Service", "PodDisruptionBudget"):
                selector = doc["spec"].get("selector")
            elif kind == "NetworkPolicy":
                selector = doc["spec"].get("podSelector")
                peers = [p for rule in doc["spec"].get("ingress") or [] for p in rule.get("from") or []]
                for peer in peers:  # the chart's own peers (by instance label) must select its pods
                    labels = (peer.get("podSelector") or {}).get("matchLabels") or {}
                    if "app.kubernetes.io/instance" in labels and "namespaceSelector" not in peer:
                        if not any(_selects(peer["podSelector"], t["metadata"].get("labels", {}))
                                   for _, t in self.pod_templates(ns)):
                            self.fail(f"{_name(doc)}: peer {peer['podSelector']} selects no rendered pod")
            else:
                continue
            if not selector:
                continue
            if not any(_selects(selector, t["metadata"].get("labels", {})) for _, t in self.pod_templates(ns)):
                self.fail(f"{_name(doc)}: selector {selector} matches no rendered pod template")

    def check_pods(self) -> None:
        for w, t in self.pod_templates():
            spec = t["spec"]
            pod_sc = spec.get("securityContext") or {}
            for c in (spec.get("initContainers") or []) + spec["containers"]:
                where = f"{_name(w)} container {c['name']}"
                image = c.get("image", "")
                if "@sha256:" not in image:
                    tag = image.rsplit("/", 1)[-1].partition(":")[2]
                    if not tag or tag == "latest":
                        self.fail(f"{where}: image {image!r} is not pinned to a version")
                sc = c.get("securityContext") or {}
                if sc.get("runAsNonRoot", pod_sc.get("runAsNonRoot")) is not True:
                    self.fail(f"{where}: runAsNonRoot is not set")
                if sc.get("allowPrivilegeEscalation") is not False:
                    self.fail(f"{where}: allowPrivilegeEscalation is not false")
                if not (c.get("resources") or {}).get("requests"):
                    self.fail(f"{where}: no resource requests")

    def selected_pods(self, selector: dict, namespace: str | None) -> list[dict]:
        return [t for _, t in self.pod_templates(namespace) if _selects(selector, t["metadata"].get("labels", {}))]

    def check_service_ports(self) -> None:
        for svc in (d for d in self.docs if d.get("kind") == "Service" and d["spec"].get("selector")):
            pods = self.selected_pods(svc["spec"]["selector"], svc["metadata"].get("namespace"))
            for port in svc["spec"].get("ports") or []:
                target = port.get("targetPort", port["port"])
                for t in pods:
                    cports = [p for c in t["spec"]["containers"] for p in c.get("ports") or []]
                    if not any(p.get("name") == target or p.get("containerPort") == target for p in cports):
                        self.fail(f"{_name(svc)}: port {port.get('name')} targets {target!r}, which the pods of "
                                  f"{t['metadata']['labels'].get(COMPONENT)} do not expose")

    def check_probes(self) -> None:
        for w, t in self.pod_templates():
            component = t["metadata"].get("labels", {}).get(COMPONENT)
            for c in t["spec"]["containers"]:
                ports = {p.get("name"): p["containerPort"] for p in c.get("ports") or []}
                if "grpc" not in ports:
                    continue
                grpc_port = ports.get("health", ports["grpc"])
                liveness = LIVENESS_SERVICE if component in LIVENESS_COMPONENTS else ""
                for probe, service in (("startupProbe", ""), ("readinessProbe", ""), ("livenessProbe", liveness)):
                    check = (c.get(probe) or {}).get("grpc") or {}
                    if check.get("port") != grpc_port:
                        self.fail(f"{_name(w)} container {c['name']}: {probe} is not a gRPC health check on "
                                  f"port {grpc_port}")
                    elif check.get("service", "") != service:
                        self.fail(f"{_name(w)} container {c['name']}: {probe} checks health service "
                                  f"{check.get('service', '')!r}, not {service!r}")

    def check_pod_grpc_ingress(self) -> None:
        """The data-plane pods' gRPC port admits the router and the control plane of this release, no one else."""
        for policy in (d for d in self.docs if d.get("kind") == "NetworkPolicy"):
            ns = policy["metadata"].get("namespace")
            pods = self.selected_pods(policy["spec"].get("podSelector") or {}, ns)
            grpc_ports = {p["containerPort"] for t in pods if t["metadata"]["labels"].get(COMPONENT) == "data-plane"
                          for c in t["spec"]["containers"] for p in c.get("ports") or [] if p.get("name") == "grpc"}
            if not grpc_ports:
                continue
            admitted: set[str] = set()
            for rule in policy["spec"].get("ingress") or []:
                ports = {p.get("port") for p in rule.get("ports") or []}
                if rule.get("ports") and not ports & grpc_ports:
                    continue
                peers = rule.get("from") or []
                if not peers:
                    self.fail(f"{_name(policy)}: the data-plane gRPC port {sorted(grpc_ports)} is open to any source")
                for peer in peers:
                    selected = self.selected_pods(peer.get("podSelector") or {}, ns) \
                        if "podSelector" in peer and "namespaceSelector" not in peer else []
                    components = {t["metadata"]["labels"].get(COMPONENT) for t in selected}
                    if not selected or not components <= POD_GRPC_PEERS:
                        self.fail(f"{_name(policy)}: peer {peer} may reach the data-plane gRPC port; only "
                                  f"{sorted(POD_GRPC_PEERS)} may")
                    admitted |= components
            if admitted != POD_GRPC_PEERS:
                self.fail(f"{_name(policy)}: the data-plane gRPC port admits {sorted(admitted)}, "
                          f"not {sorted(POD_GRPC_PEERS)}")

    def check_autoscalers(self) -> None:
        for hpa in (d for d in self.docs if d.get("kind") == "HorizontalPodAutoscaler"):
            ref = hpa["spec"]["scaleTargetRef"]
            target = next((w for w in self.pods if w["kind"] == ref["kind"]
                           and w["metadata"]["name"] == ref["name"]
                           and w["metadata"].get("namespace") == hpa["metadata"].get("namespace")), None)
            if target is None:
                self.fail(f"{_name(hpa)}: scales {ref['kind']}/{ref['name']}, which is not rendered")
            elif "replicas" in target["spec"]:
                self.fail(f"{_name(hpa)}: {_name(target)} sets replicas, which each upgrade would reset")

    def check_service_monitor(self, sm: dict) -> None:
        where = _name(sm)
        meta, spec = sm.get("metadata") or {}, sm.get("spec")
        if not DNS_LABEL_RE.match(str(meta.get("name", ""))):
            self.fail(f"{where}: metadata.name is not a DNS subdomain")
        if not isinstance(spec, dict):
            self.fail(f"{where}: spec missing")
            return
        for extra in sorted(set(sm) - {"apiVersion", "kind", "metadata", "spec"}):
            self.fail(f"{where}: unknown top-level field {extra!r}")
        for extra in sorted(set(spec) - SM_SPEC_FIELDS):
            self.fail(f"{where}: spec.{extra} is not a ServiceMonitor field")
        selector = spec.get("selector")
        if not isinstance(selector, dict) or not (selector.get("matchLabels") or selector.get("matchExpressions")):
            self.fail(f"{where}: spec.selector must hold matchLabels or matchExpressions")
            return
        for k, v in (selector.get("matchLabels") or {}).items():
            if not isinstance(k, str) or not isinstance(v, str):
                self.fail(f"{where}: spec.selector.matchLabels {k!r}: {v!r} must map strings to strings")
        endpoints = spec.get("endpoints")
        if not isinstance(endpoints, list) or not endpoints:
            self.fail(f"{where}: spec.endpoints must be a non-empty list")
            return
        namespaces = ((spec.get("namespaceSelector") or {}).get("matchNames")
                      or [meta.get("namespace")])
        services = [d for d in self.docs if d.get("kind") == "Service"
                    and d["metadata"].get("namespace") in namespaces
                    and _selects(selector, d["metadata"].get("labels", {}))]
        if not services:
            self.fail(f"{where}: selects no rendered Service")
        for i, ep in enumerate(endpoints):
            at = f"{where}: spec.endpoints[{i}]"
            for extra in sorted(set(ep) - SM_ENDPOINT_FIELDS):
                self.fail(f"{at}.{extra} is not an endpoint field")
            if not isinstance(ep.get("port"), str) or not ep["port"]:
                self.fail(f"{at}.port must name a Service port")
                continue
            for field in ("interval", "scrapeTimeout"):
                if field in ep and not DURATION_RE.match(str(ep[field])):
                    self.fail(f"{at}.{field} {ep[field]!r} is not a Prometheus duration")
            if "interval" in ep and "scrapeTimeout" in ep and _seconds(ep["scrapeTimeout"]) > _seconds(ep["interval"]):
                self.fail(f"{at}: scrapeTimeout is longer than interval")
            if ep.get("scheme", "http") not in ("http", "https", "HTTP", "HTTPS"):
                self.fail(f"{at}.scheme must be http or https")
            for svc in services:
                port = next((p for p in svc["spec"]["ports"] if p.get("name") == ep["port"]), None)
                if port is None:
                    self.fail(f"{at}: Service {svc['metadata']['name']} has no port named {ep['port']!r}")
                    continue
                target = port.get("targetPort", port["port"])
                pods = [t for _, t in self.pod_templates(svc["metadata"].get("namespace"))
                        if _selects(svc["spec"].get("selector") or {}, t["metadata"].get("labels", {}))]
                for t in pods:
                    cports = [p for c in t["spec"]["containers"] for p in c.get("ports") or []]
                    if not any(p.get("name") == target or p.get("containerPort") == target for p in cports):
                        self.fail(f"{at}: pods behind {svc['metadata']['name']} expose no port {target!r}")

    def check_dashboards(self) -> None:
        for doc in self.docs:
            if doc.get("kind") != "ConfigMap" or (doc["metadata"].get("labels") or {}).get("grafana_dashboard") != "1":
                continue
            for key, text in (doc.get("data") or {}).items():
                try:
                    dash = json.loads(text)
                except json.JSONDecodeError as e:
                    self.fail(f"{_name(doc)}: {key} is not valid JSON: {e}")
                    continue
                exprs = " ".join(t.get("expr", "") for p in dash.get("panels", []) for t in p.get("targets", []))
                for metric in DASHBOARD_METRICS:
                    if metric not in exprs:
                        self.fail(f"{_name(doc)}: {key} has no panel querying {metric}")
                for name in undefined_metrics(exprs, self.defined):
                    self.fail(f"{_name(doc)}: {key} queries {name}, which no process exports")
                ids = [p["id"] for p in dash.get("panels", [])]
                if len(ids) != len(set(ids)):
                    self.fail(f"{_name(doc)}: {key} repeats a panel id")


    def check_prometheus_rule(self, pr: dict) -> None:
        where = _name(pr)
        if not DNS_LABEL_RE.match(str((pr.get("metadata") or {}).get("name", ""))):
            self.fail(f"{where}: metadata.name is not a DNS subdomain")
        for extra in sorted(set(pr) - {"apiVersion", "kind", "metadata", "spec"}):
            self.fail(f"{where}: unknown top-level field {extra!r}")
        groups = (pr.get("spec") or {}).get("groups")
        if not isinstance(groups, list) or not groups:
            self.fail(f"{where}: spec.groups must be a non-empty list")
            return
        alerts: list[str] = []
        for g in groups:
            for extra in sorted(set(g) - {"name", "interval", "rules", "partial_response_strategy", "limit"}):
                self.fail(f"{where}: group {g.get('name')!r} has unknown field {extra!r}")
            for rule in g.get("rules") or []:
                at = f"{where}: rule {rule.get('alert') or rule.get('record')!r}"
                for extra in sorted(set(rule) - PR_RULE_FIELDS):
                    self.fail(f"{at} has unknown field {extra!r}")
                if not isinstance(rule.get("expr"), str) or not rule["expr"].strip():
                    self.fail(f"{at} has no expr")
                    continue
                for name in undefined_metrics(rule["expr"], self.defined):
                    self.fail(f"{at} reads {name}, which no process exports")
                if "for" in rule and not DURATION_RE.match(str(rule["for"])):
                    self.fail(f"{at}: for {rule['for']!r} is not a Prometheus duration")
                if "alert" in rule:
                    alerts.append(rule["alert"])
                    if (rule.get("labels") or {}).get("severity") not in SEVERITIES:
                        self.fail(f"{at}: labels.severity must be one of {sorted(SEVERITIES)}")
                    if not (rule.get("annotations") or {}).get("summary"):
                        self.fail(f"{at} has no summary annotation")
        for name in sorted({a for a in alerts if alerts.count(a) > 1}):
            self.fail(f"{where}: alert {name} is defined twice")
        for name in ALERTS:
            if name not in alerts:
                self.fail(f"{where}: has no alert {name}")


def manifests(rendered: Path, core_out: Path) -> int:
    docs = [d for d in yaml.safe_load_all(rendered.read_text()) if d]
    core, crds = [], []
    for doc in docs:
        (crds if (doc.get("apiVersion"), doc.get("kind")) in CRD_KINDS else core).append(doc)
    core_out.write_text(yaml.safe_dump_all(core, sort_keys=False))
    checker = Checker(docs)
    checker.check_selectors()
    checker.check_service_ports()
    checker.check_pods()
    checker.check_probes()
    checker.check_pod_grpc_ingress()
    checker.check_autoscalers()
    checker.check_dashboards()
    for doc in crds:
        if (doc.get("apiVersion"), doc.get("kind")) == PROMETHEUS_RULE:
            checker.check_prometheus_rule(doc)
        else:
            checker.check_service_monitor(doc)
    for message in checker.errors:
        print(f"chart_checks: {message}", file=sys.stderr)
    kinds = sorted({d["kind"] for d in docs})
    print(f"chart_checks: {len(docs)} resources ({', '.join(kinds)}); {len(crds)} checked here "
          f"({', '.join(_name(d) for d in crds) or 'none'}); {len(checker.errors)} problems")
    return 1 if checker.errors else 0


_KEY_RE = re.compile(r"^(\s*)([A-Za-z0-9_]+):(.*)$")


def _values_keys(text: str) -> tuple[dict[str, str], set[str]]:
    """Maps each key path of values.yaml to its "# --" comment ("" when it has none); also returns the
    leaf paths (scalars, lists, empty maps). Items of a list value are part of that one value."""
    docs: dict[str, str] = {}
    leaves: set[str] = set()
    stack: list[tuple[int, str]] = []  # enclosing maps: (indentation, key)
    comment: list[str] | None = None  # the "# --" comment being read
    skip_deeper_than: int | None = None  # inside a list item
    lines = text.splitlines()
    for i, line in enumerate(lines):
        stripped = line.strip()
        indent = len(line) - len(line.lstrip())
        if not stripped:
            continue
        if skip_deeper_than is not None and indent > skip_deeper_than:
            continue
        skip_deeper_than = None
        if stripped.startswith("# --"):
            comment = [stripped[4:].strip()]
            continue
        if stripped.startswith("#"):
            if comment is not None:
                comment.append(stripped[1:].strip())
            continue
        if stripped.startswith("- "):
            skip_deeper_than = indent
            continue
        m = _KEY_RE.match(line)
        if not m:
            continue
        while stack and stack[-1][0] >= indent:
            stack.pop()
        path = ".".join([k for _, k in stack] + [m.group(2)])
        docs[path] = " ".join(comment or [])
        comment = None
        if m.group(3).strip() and not m.group(3).strip().startswith("#"):
            leaves.add(path)
            continue
        nxt = next((ln for ln in lines[i + 1:] if ln.strip() and not ln.strip().startswith("#")), "")
        if nxt.strip().startswith("- ") or len(nxt) - len(nxt.lstrip()) <= indent:
            leaves.add(path)
        else:
            stack.append((indent, m.group(2)))
    return docs, leaves


def values_table(values: Path) -> str:
    """The README's values table: every documented value, its default and its comment."""
    text = values.read_text()
    defaults = yaml.safe_load(text)
    docs, _ = _values_keys(text)
    rows = ["| Key | Default | Description |", "|---|---|---|"]
    for path, doc in docs.items():
        if not doc:
            continue
        value = defaults
        for key in path.split("."):
            value = value[key]
        default = json.dumps(value, separators=(", ", ": "))
        doc = doc.replace("|", "\\|").replace("<", "\\<")
        rows.append(f"| `{path}` | `{default}` | {doc} |")
    return "\n".join(rows) + "\n"


def values_docs(values: Path, readme: Path) -> int:
    docs, leaves = _values_keys(values.read_text())
    errors = []
    for leaf in sorted(leaves):
        parts = leaf.split(".")
        if not any(docs.get(".".join(parts[:n])) for n in range(1, len(parts) + 1)):
            errors.append(f"{values.name}: {leaf} has no '# --' comment (on it or an enclosing key)")
    if values_table(values) not in readme.read_text():
        errors.append(f"{readme.name}: the values table differs from values.yaml; regenerate it with "
                      f"`python helm/chart_checks.py values-table {values}`")
    for e in errors:
        print(f"chart_checks: {e}", file=sys.stderr)
    documented = sum(1 for d in docs.values() if d)
    print(f"chart_checks: {documented} documented values, {len(leaves)} leaves; {len(errors)} problems")
    return 1 if errors else 0


def main(argv: list[str]) -> int:
    if len(argv) == 3 and argv[0] == "manifests":
        return manifests(Path(argv[1]), Path(argv[2]))
    if len(argv) == 3 and argv[0] == "values-docs":
        return values_docs(Path(argv[1]), Path(argv[2]))
    if len(argv) == 2 and argv[0] == "values-table":
        sys.stdout.write(values_table(Path(argv[1])))
        return 0
    print(__doc__, file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
