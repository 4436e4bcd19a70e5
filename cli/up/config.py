"""The configuration of ``lorafleet up``: one frozen object, validated on construction, and the flags
that build it."""

from __future__ import annotations

import argparse
from dataclasses import dataclass, field
from pathlib import Path

from conventions import defaults
from conventions.home import TOKEN_FILE_NAME, up_dir


class StackError(Exception):
    """The stack cannot start; the message says what to change."""


@dataclass(frozen=True)
class StackConfig:
    """What ``lorafleet up`` runs; built from its flags."""

    data_dir: Path = field(default_factory=up_dir)
    host: str = defaults.HOST
    redis_port: int = defaults.REDIS_PORT
    control_plane_port: int = defaults.CONTROL_PLANE_PORT
    control_plane_metrics_port: int = defaults.CONTROL_PLANE_METRICS_PORT
    pod_port: int = defaults.POD_PORT
    pod_metrics_port: int = defaults.POD_METRICS_PORT
    router_port: int = defaults.ROUTER_PORT
    router_metrics_port: int = defaults.ROUTER_METRICS_PORT
    router_http_port: int = defaults.ROUTER_HTTP_PORT
    model: Path | None = None  # None: the demo model, fetched by the pod on first start
    device: str = defaults.DEVICE
    dtype: str = defaults.DTYPE
    max_loras: int = defaults.MAX_LORAS
    # The pod's --max-queue-delay. A fleet pod refuses a request it could not start in time so that the
    # router retries it on another pod; the stack's one pod has no other, so by default it queues instead
    # (a 2-core CPU pod at the fleet default of 1.5 s refused one of a handful of concurrent questions).
    max_queue_delay_s: float = 0.0
    adapter_roots: tuple[Path, ...] = ()
    token_file: Path | None = None  # None: data_dir/admin-token, generated when missing
    redis_server: str | None = None
    start_timeout_s: float = 600.0
    stop_timeout_s: float = 30.0

    def __post_init__(self) -> None:
        ports = self.ports()
        for flag, port in ports.items():
            if not 1 <= port <= 65535:
                raise StackError(f"{flag} {port} is not a TCP port; use 1-65535")
        if len(set(ports.values())) != len(ports):
            raise StackError(f"the ports must all differ: {', '.join(f'{k} {v}' for k, v in ports.items())}")
        if not 0 <= self.max_queue_delay_s < float("inf"):
            raise StackError(f"--max-queue-delay must be 0 (no limit) or a positive number of seconds, "
                             f"got {self.max_queue_delay_s}")
        if self.start_timeout_s <= 0 or self.stop_timeout_s <= 0:
            raise StackError("--start-timeout and --stop-timeout must be positive")
        if self.token_file is not None and not self.token_file.is_file():
            raise StackError(f"--token-file {self.token_file} is not a file")

    def ports(self) -> dict[str, int]:
        """Each port by its flag."""
        return {_flag(name): getattr(self, name) for name in PORTS}

    @property
    def resolved_token_file(self) -> Path:
        return self.token_file or self.data_dir / TOKEN_FILE_NAME

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


# Every port the stack listens on, by its StackConfig field (the flag is the field's name, dashed).
PORTS = {
    "redis_port": "Redis port",
    "control_plane_port": "control plane gRPC port",
    "control_plane_metrics_port": "control plane /metrics port",
    "pod_port": "data-plane pod gRPC port",
    "pod_metrics_port": "data-plane pod /metrics port",
    "router_port": "router gRPC port, the clients' Generate endpoint",
    "router_metrics_port": "router /metrics port",
    "router_http_port": "router OpenAI-compatible HTTP API port",
}


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def add_arguments(p: argparse.ArgumentParser) -> None:
    d = StackConfig(data_dir=Path("."))
    p.add_argument("--data-dir", type=Path, help="Redis's append-only file, logs, pid file and admin token "
                                                 "(default: $LORAFLEET_HOME/up)")
    p.add_argument("--host", default=d.host, help=f"address every server listens on (default {d.host})")
    for name, what in PORTS.items():
        p.add_argument(_flag(name), type=int, default=getattr(d, name), help=f"{what} (default {getattr(d, name)})")
    p.add_argument("--model", type=Path, help="Hugging Face model directory (default: the demo model)")
    p.add_argument("--device", default=d.device, choices=["cpu", "cuda"], help="the pod's compute device")
    p.add_argument("--dtype", default=d.dtype, choices=defaults.DTYPES,
                   help="the pod's precision (see lorafleet data-plane --help)")
    p.add_argument("--max-loras", type=int, default=d.max_loras, help="adapter slots on the compute device")
    p.add_argument("--max-queue-delay", type=float, default=d.max_queue_delay_s, metavar="SECONDS",
                   help=f"the pod's --max-queue-delay (default {d.max_queue_delay_s}: no limit. The stack has one pod, "
                        "so a request it refused would have no other pod to go to: it queues instead. A fleet pod's "
                        "default is lorafleet data-plane's)")
    p.add_argument("--adapter-root", type=Path, action="append",
                   help="another directory the pod may load adapters from (repeatable; default: only the demo "
                        "adapters' directory and DATA_DIR/adapters)")
    p.add_argument("--token-file", type=Path,
                   help="admin token file to use (default: DATA_DIR/admin-token, generated when missing)")
    p.add_argument("--redis-server", help="redis-server binary (default: the one beside Python, then PATH)")
    p.add_argument("--start-timeout", type=float, default=d.start_timeout_s,
                   help="seconds the pod may take to serve (the first start fetches the demo model)")
    p.add_argument("--stop-timeout", type=float, default=d.stop_timeout_s,
                   help="seconds each process gets after SIGTERM before it is killed")


def config_from_args(args: argparse.Namespace) -> StackConfig:
    return StackConfig(
        data_dir=(args.data_dir or up_dir()).resolve(), host=args.host,
        **{name: getattr(args, name) for name in PORTS},
        model=args.model.resolve() if args.model else None, device=args.device, dtype=args.dtype,
        max_loras=args.max_loras, max_queue_delay_s=args.max_queue_delay,
        adapter_roots=tuple(r.resolve() for r in args.adapter_root or ()),
        token_file=args.token_file.resolve() if args.token_file else None, redis_server=args.redis_server,
        start_timeout_s=args.start_timeout, stop_timeout_s=args.stop_timeout)
