"""Prometheus and promtool for the monitoring tests, and the chart's alert rules as a rule file.

Both binaries come from Debian's ``prometheus`` package, fetched with ``apt-get download`` (no root
needed) and unpacked with ``dpkg-deb -x`` into the venv's ``tools/`` folder on first use, as
helm/lint.sh keeps helm there. The rules are the chart's PrometheusRule, rendered by that helm.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
import yaml

REPO = Path(__file__).resolve().parents[2]
TOOLS = Path(sys.prefix) / "tools"
PROMETHEUS_DIR = TOOLS / "prometheus"
HELM = TOOLS / "helm"
NAMESPACE = "lorafleet"  # the release namespace the rules are rendered for


def _works(binary: Path, *args: str) -> bool:
    try:
        return subprocess.run([str(binary), *(args or ("--version",))], capture_output=True, timeout=30).returncode == 0
    except OSError:
        return False


def prometheus_binaries() -> tuple[Path, Path]:
    """(prometheus, promtool), fetched on first use; skips the calling test when they cannot be had."""
    prometheus, promtool = PROMETHEUS_DIR / "usr/bin/prometheus", PROMETHEUS_DIR / "usr/bin/promtool"
    if _works(prometheus) and _works(promtool):
        return prometheus, promtool
    if not (shutil.which("apt-get") and shutil.which("dpkg-deb")):
        pytest.skip("promtool and prometheus come from Debian's prometheus package: this machine has no "
                    "apt-get/dpkg-deb to fetch it")
    TOOLS.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=TOOLS) as work:
        got = subprocess.run(["apt-get", "download", "prometheus"], cwd=work, capture_output=True, text=True,
                             timeout=300)
        debs = list(Path(work).glob("prometheus_*.deb"))
        if got.returncode != 0 or not debs:
            pytest.skip(f"could not download Debian's prometheus package (apt-get download prometheus: "
                        f"{(got.stderr or got.stdout).strip()[-300:]}); run `apt-get update` or give this "
                        f"machine access to a Debian mirror")
        unpacked = Path(work) / "root"
        subprocess.run(["dpkg-deb", "-x", str(debs[0]), str(unpacked)], check=True, timeout=300)
        shutil.rmtree(PROMETHEUS_DIR, ignore_errors=True)
        unpacked.rename(PROMETHEUS_DIR)  # whole or not at all: a second run never sees half a tree
    return prometheus, promtool


def helm_template(*helm_args: str) -> str:
    """The chart rendered for namespace NAMESPACE with ``helm_args``; skips when helm has not been fetched yet."""
    if not _works(HELM, "version", "--short"):
        pytest.skip(f"helm not found at {HELM}: `make helm-lint` fetches it")
    return subprocess.run(
        [str(HELM), "template", "lorafleet", str(REPO / "helm/lorafleet"), "--namespace", NAMESPACE, *helm_args],
        capture_output=True, text=True, check=True, timeout=120,
        env={"HELM_CONFIG_HOME": str(TOOLS / "helm-home/config"), "HELM_CACHE_HOME": str(TOOLS / "helm-home/cache"),
             "HELM_DATA_HOME": str(TOOLS / "helm-home/data"), "PATH": "/usr/bin:/bin"}).stdout


def render_rules(out: Path, *helm_args: str) -> dict:
    """Writes the chart's PrometheusRule spec (its rule groups) to ``out`` as a Prometheus rule file and
    returns it."""
    rendered = helm_template("--set", "metrics.prometheusRule.enabled=true",
                             "--show-only", "templates/prometheusrule.yaml", *helm_args)
    spec = yaml.safe_load(rendered)["spec"]
    out.write_text(yaml.safe_dump(spec, sort_keys=False))
    return spec


def alert_names(spec: dict) -> list[str]:
    return [r["alert"] for g in spec["groups"] for r in g["rules"] if "alert" in r]
