"""Every port, limit and device default is stated once, in conventions/defaults.py: the pod's and the
control plane's flags, the command line, ``lorafleet up``, the engine, the Dockerfiles and the chart
agree with it, so that a bare server listens where a bare client dials."""

from __future__ import annotations

import argparse
import dataclasses
import re
from pathlib import Path

import pytest
import yaml

from cli.admin_client import control_plane_target
from cli.main import build_parser as cli_parser
from cli.main import main as cli_main
from cli.up.config import config_from_args as up_config
from control_plane.config import build_parser as control_plane_parser
from conventions import defaults
from conventions.home import default_token_file
from data_plane.config import DataPlaneConfig
from data_plane.config import add_arguments as add_pod_arguments
from router.config import RouterConfig

ROOT = Path(__file__).resolve().parents[1]
CHART = ROOT / "helm" / "lorafleet"


@pytest.fixture(autouse=True)
def _no_endpoint_environment(monkeypatch, tmp_path):
    for name in ("LORAFLEET_ENDPOINT", "LORAFLEET_CONTROL_PLANE"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("LORAFLEET_HOME", str(tmp_path))


def _pod_flags() -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_pod_arguments(parser)
    return parser.parse_args([])


def _control_plane_flags() -> argparse.Namespace:
    return control_plane_parser().parse_args(["--redis-url", "redis://r:1/0", "--admin-token-file", "token"])


def _router_flags() -> argparse.Namespace:
    from router.config import build_parser as router_parser

    return router_parser().parse_args(["--admin-token-file", "token"])


def test_a_bare_pod_listens_on_the_default_ports_with_the_default_limits():
    args = _pod_flags()
    assert (args.host, args.port, args.metrics_port) == (defaults.HOST, defaults.POD_PORT, defaults.POD_METRICS_PORT)
    assert (args.device, args.dtype) == (defaults.DEVICE, defaults.DTYPE)
    assert (args.max_loras, args.max_cpu_loras, args.max_lora_rank) \
        == (defaults.MAX_LORAS, defaults.MAX_CPU_LORAS, defaults.MAX_LORA_RANK)


def test_a_bare_control_plane_listens_on_the_default_ports():
    args = _control_plane_flags()
    assert (args.host, args.port, args.metrics_port) \
        == (defaults.HOST, defaults.CONTROL_PLANE_PORT, defaults.CONTROL_PLANE_METRICS_PORT)


def test_the_command_line_dials_where_bare_servers_listen():
    control_plane, router = _control_plane_flags(), _router_flags()
    generate = cli_parser().parse_args(["generate", "hello"])
    assert generate.endpoint == defaults.ROUTER_ENDPOINT == f"{router.host}:{router.port}"
    assert (generate.device, generate.dtype) == (defaults.DEVICE, defaults.DTYPE)
    pods = cli_parser().parse_args(["pods"])
    assert control_plane_target(pods.control_plane) == defaults.CONTROL_PLANE_ENDPOINT \
        == f"{control_plane.host}:{control_plane.port}"


def test_a_bare_router_dials_the_default_control_plane_and_listens_on_the_default_ports():
    from router.config import RouterConfig

    router = {f.name: f.default for f in dataclasses.fields(RouterConfig)}
    assert (router["control_plane"], router["host"]) == (defaults.CONTROL_PLANE_ENDPOINT, defaults.HOST)
    assert (router["port"], router["metrics_port"], router["http_port"]) \
        == (defaults.ROUTER_PORT, defaults.ROUTER_METRICS_PORT, defaults.ROUTER_HTTP_PORT)


def test_no_two_processes_share_a_default_port():
    ports = {name: value for name, value in vars(defaults).items() if name.endswith("_PORT")}
    assert len(ports) == 8, f"a port was added or removed; update this count: {sorted(ports)}"
    assert len(set(ports.values())) == len(ports), ports


def test_up_starts_the_servers_the_command_line_dials(tmp_path):
    stack = up_config(cli_parser().parse_args(["up"]))
    assert (stack.host, stack.redis_port) == (defaults.HOST, defaults.REDIS_PORT)
    assert (stack.control_plane_port, stack.control_plane_metrics_port, stack.pod_port, stack.pod_metrics_port) \
        == (defaults.CONTROL_PLANE_PORT, defaults.CONTROL_PLANE_METRICS_PORT, defaults.POD_PORT,
            defaults.POD_METRICS_PORT)
    assert (stack.router_port, stack.router_metrics_port, stack.router_http_port) \
        == (defaults.ROUTER_PORT, defaults.ROUTER_METRICS_PORT, defaults.ROUTER_HTTP_PORT)
    assert (stack.control_plane, stack.pod, stack.router) \
        == (defaults.CONTROL_PLANE_ENDPOINT, defaults.POD_ENDPOINT, defaults.ROUTER_ENDPOINT)
    assert (stack.device, stack.dtype, stack.max_loras) == (defaults.DEVICE, defaults.DTYPE, defaults.MAX_LORAS)
    assert stack.resolved_token_file == default_token_file() == tmp_path.resolve() / "up" / "admin-token"


def test_ups_one_pod_queues_a_burst_that_a_fleet_pod_would_refuse(capsys):
    # a fleet pod refuses what it cannot start within --max-queue-delay, for the router to retry elsewhere;
    # up's stack has no elsewhere, so its pod queues (a 2-core CPU pod refused one of a handful of questions)
    assert up_config(cli_parser().parse_args(["up"])).max_queue_delay == 0
    assert DataPlaneConfig(model=None).max_queue_delay > 0
    with pytest.raises(SystemExit):
        cli_main(["up", "--help"])
    assert "--max-queue-delay (default 0.0: no limit." in " ".join(capsys.readouterr().out.split())


def test_engine_limits_have_no_defaults_of_their_own():
    from data_plane.engine.engine import EngineLimits

    pod = DataPlaneConfig(model=None)
    for field in dataclasses.fields(EngineLimits):
        if field.default is dataclasses.MISSING and field.default_factory is dataclasses.MISSING:
            continue
        name = field.name if hasattr(pod, field.name) else field.name.removesuffix("_s")  # the flag: seconds unsaid
        assert hasattr(pod, name), f"EngineLimits.{field.name} has a default the pod's config does not state"
        assert field.default == getattr(pod, name), f"EngineLimits.{field.name} disagrees with DataPlaneConfig"


@pytest.mark.parametrize(("dockerfile", "ports"), [
    ("control-plane.Dockerfile", {defaults.CONTROL_PLANE_PORT, defaults.CONTROL_PLANE_METRICS_PORT}),
    ("data-plane.Dockerfile", {defaults.POD_PORT, defaults.POD_METRICS_PORT}),
    ("router.Dockerfile", {defaults.ROUTER_PORT, defaults.ROUTER_METRICS_PORT, defaults.ROUTER_HTTP_PORT}),
])
def test_the_images_expose_the_default_ports(dockerfile, ports):
    text = (ROOT / "helm" / "images" / dockerfile).read_text()
    exposed = {int(p) for line in re.findall(r"^EXPOSE\s+(.+)$", text, re.M) for p in line.split()}
    assert exposed == ports


def test_the_chart_serves_on_the_default_ports():
    values = yaml.safe_load((CHART / "values.yaml").read_text())
    assert (values["controlPlane"]["port"], values["controlPlane"]["metricsPort"]) \
        == (defaults.CONTROL_PLANE_PORT, defaults.CONTROL_PLANE_METRICS_PORT)
    assert (values["dataPlane"]["port"], values["dataPlane"]["metricsPort"]) \
        == (defaults.POD_PORT, defaults.POD_METRICS_PORT)
    assert (values["router"]["port"], values["router"]["metricsPort"], values["router"]["httpPort"]) \
        == (defaults.ROUTER_PORT, defaults.ROUTER_METRICS_PORT, defaults.ROUTER_HTTP_PORT)
    assert values["redis"]["port"] == defaults.REDIS_PORT


def test_the_chart_routes_by_prefix_and_bounds_load_as_the_processes_do_by_default():
    values = yaml.safe_load((CHART / "values.yaml").read_text())
    assert values["router"]["prefixWeight"] == RouterConfig.prefix_weight
    assert values["dataPlane"]["prefixReportSize"] == DataPlaneConfig.prefix_report_size
    assert _template_flags("router.yaml")["--prefix-weight"] == "{{ $r.prefixWeight | quote }}"
    assert values["router"]["loadBound"] == RouterConfig.load_bound
    assert _template_flags("router.yaml")["--load-bound"] == "{{ $r.loadBound | quote }}"
    assert values["router"]["shareBound"] == RouterConfig.share_bound
    assert _template_flags("router.yaml")["--share-bound"] == "{{ $r.shareBound | quote }}"
    assert _template_flags("data-plane.yaml")["--prefix-report-size"] == "{{ $dp.prefixReportSize | quote }}"


def _template_flags(template: str) -> dict[str, str]:
    """The container's ``- --flag`` / ``- value`` argument pairs, as written in the template."""
    lines = [line.strip() for line in (CHART / "templates" / template).read_text().splitlines()]
    return {a[2:]: b[2:] for a, b in zip(lines, lines[1:], strict=False)
            if re.fullmatch(r"- --[a-z-]+", a) and b.startswith("- ")}


@pytest.mark.parametrize(("template", "flags"), [
    ("control-plane.yaml", {"--host": "0.0.0.0", "--port": "{{ $cp.port | quote }}",
                            "--metrics-port": "{{ $cp.metricsPort | quote }}"}),
    # The chart sizes pods for a GPU pool (its own device, dtype and slot counts), so it passes them.
    ("data-plane.yaml", {"--host": "0.0.0.0", "--port": "{{ $dp.port | quote }}",
                         "--metrics-port": "{{ $dp.metricsPort | quote }}", "--device": "{{ $dp.device }}",
                         "--dtype": "{{ $dp.dtype }}", "--compute-threads": "{{ $dp.computeThreads | quote }}",
                         "--max-loras": "{{ $dp.maxLoras | quote }}",
                         "--max-cpu-loras": "{{ $dp.maxCpuLoras | quote }}",
                         "--max-lora-rank": "{{ $dp.maxLoraRank | quote }}"}),
    ("router.yaml", {"--host": "0.0.0.0", "--port": "{{ $r.port | quote }}",
                     "--metrics-port": "{{ $r.metricsPort | quote }}", "--http-port": "{{ $r.httpPort | quote }}"}),
])
def test_the_chart_passes_its_own_choices_as_flags(template, flags):
    passed = _template_flags(template)
    assert {flag: passed.get(flag) for flag in flags} == flags
