"""The configuration of ``lorafleet up``: one frozen object, validated on construction, and the flags
that build it."""

from __future__ import annotations

import argparse
import dataclasses
from dataclasses import dataclass
from pathlib import Path

from conventions import defaults
from conventions.flags import add_options, flag_name, from_args, option
from conventions.home import TOKEN_FILE_NAME, up_dir

PORTS = "ports"


class StackError(Exception):
    """The stack cannot start; the message says what to change."""


def _resolved(text: str) -> Path:
    return Path(text).resolve()


@dataclass(frozen=True)
class StackConfig:
    """What ``lorafleet up`` runs; each field with ``option`` is the flag of its name (conventions/flags.py)."""

    data_dir: Path = option("Redis's append-only file, logs, pid file and admin token (default: $LORAFLEET_HOME/up)",
                            default_factory=lambda: up_dir().resolve(), parse=_resolved)
    host: str = option("address every server listens on", defaults.HOST)
    redis_port: int = option("Redis port", defaults.REDIS_PORT, group=PORTS)
    control_plane_port: int = option("control plane gRPC port", defaults.CONTROL_PLANE_PORT, group=PORTS)
    control_plane_metrics_port: int = option("control plane /metrics port", defaults.CONTROL_PLANE_METRICS_PORT,
                                             group=PORTS)
    pod_port: int = option("data-plane pod gRPC port", defaults.POD_PORT, group=PORTS)
    pod_metrics_port: int = option("data-plane pod /metrics port", defaults.POD_METRICS_PORT, group=PORTS)
    router_port: int = option("router gRPC port, the clients' Generate endpoint", defaults.ROUTER_PORT, group=PORTS)
    router_metrics_port: int = option("router /metrics port", defaults.ROUTER_METRICS_PORT, group=PORTS)
    router_http_port: int = option("router OpenAI-compatible HTTP API port", defaults.ROUTER_HTTP_PORT, group=PORTS)
    # None: the demo model, fetched by the pod on first start
    model: Path | None = option("Hugging Face model directory (default: the demo model)", None, parse=_resolved)
    device: str = option("the pod's compute device", defaults.DEVICE, choices=("cpu", "cuda"))
    dtype: str = option("the pod's precision (see lorafleet data-plane --help)", defaults.DTYPE,
                        choices=defaults.DTYPES)
    max_loras: int = option("adapter slots on the compute device", defaults.MAX_LORAS)
    # The pod's --max-queue-delay. A fleet pod refuses a request it could not start in time so that the
    # router retries it on another pod; the stack's one pod has no other, so by default it queues instead
    # (a 2-core CPU pod at the fleet default of 1.5 s refused one of a handful of concurrent questions).
    max_queue_delay: float = option(
        "the pod's --max-queue-delay (default 0.0: no limit. The stack has one pod, so a request it"
        " refused would have no other pod to go to: it queues instead. A fleet pod's default is lorafleet"
        " data-plane's)", 0.0, metavar="SECONDS")
    adapter_roots: tuple[Path, ...] = option(
        "another directory the pod may load adapters from (repeatable; default: only the demo adapters' directory"
        " and DATA_DIR/adapters)", (), parse=_resolved)
    # None: data_dir/admin-token, generated when missing
    token_file: Path | None = option(
        "admin token file to use (default: DATA_DIR/admin-token, generated when missing)", None, parse=_resolved)
    tenants_file: Path | None = option(
        "the router's tenants file (lorafleet router --tenants-file): both doors then ask for a tenant's key"
        " (default: none, both doors open)", None, parse=_resolved)
    redis_server: str | None = option("redis-server binary (default: the one beside Python, then PATH)", None)
    start_timeout: float = option("seconds the pod may take to serve (the first start fetches the demo model)",
                                  600.0)
    stop_timeout: float = option("seconds each process gets after SIGTERM before it is killed", 30.0)

    def __post_init__(self) -> None:
        ports = self.ports()
        for flag, port in ports.items():
            if not 1 <= port <= 65535:
                raise StackError(f"{flag} {port} is not a TCP port; use 1-65535")
        if len(set(ports.values())) != len(ports):
            raise StackError(f"the ports must all differ: {', '.join(f'{k} {v}' for k, v in ports.items())}")
        if not 0 <= self.max_queue_delay < float("inf"):
            raise StackError(f"--max-queue-delay must be 0 (no limit) or a positive number of seconds, "
                             f"got {self.max_queue_delay}")
        if self.start_timeout <= 0 or self.stop_timeout <= 0:
            raise StackError("--start-timeout and --stop-timeout must be positive")
        if self.token_file is not None and not self.token_file.is_file():
            raise StackError(f"--token-file {self.token_file} is not a file")
        if self.tenants_file is not None and not self.tenants_file.is_file():
            raise StackError(f"--tenants-file {self.tenants_file} is not a file")

    def ports(self) -> dict[str, int]:
        """Each port by its flag."""
        return {flag_name(f.name): getattr(self, f.name) for f in dataclasses.fields(self) if f.name.endswith("_port")}

    @property
    def resolved_token_file(self) -> Path:
        return self.token_file or self.data_dir / TOKEN_FILE_NAME

    @property
    def reader_token_file(self) -> Path:
        """The readers' token (the router reads the registry and the pod's state with it), generated when missing."""
        return self.data_dir / "reader-token"

    @property
    def pod_token_file(self) -> Path:
        """The token between the control plane and the pod, both ways, generated when missing."""
        return self.data_dir / "pod-token"

    @property
    def control_plane(self) -> str:
        return f"{self.host}:{self.control_plane_port}"

    @property
    def pod(self) -> str:
        return f"{self.host}:{self.pod_port}"

    @property
    def router(self) -> str:
        return f"{self.host}:{self.router_port}"

    @property
    def router_base_url(self) -> str:
        """The router's OpenAI-compatible API, as the ``openai`` client's base_url takes it."""
        return f"http://{self.host}:{self.router_http_port}/v1"


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_options(p, StackConfig)


def config_from_args(args: argparse.Namespace) -> StackConfig:
    return from_args(StackConfig, args)
