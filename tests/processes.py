"""Real processes for integration tests, on loopback ports: data-plane pods (``python -m data_plane.server``,
waited on through the gRPC health service) and control-plane replicas (``python -m control_plane.server``)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import urllib.request
from pathlib import Path

import grpc
from lorafleet.v1 import data_plane_admin_pb2 as dpa
from lorafleet.v1 import data_plane_admin_pb2_grpc, generation_pb2_grpc

from data_plane.child_process import spawn, stop_process, tail, wait_listening, wait_serving
from tests.control_plane.conftest import free_port

REPO = Path(__file__).resolve().parent.parent
POD_TOKEN = "pod-admin-token-for-tests"
BASE_MODEL = "smollm2-135m"


def scrape(port: int) -> str:
    """The Prometheus text a process serves on ``port``."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as r:
        return r.read().decode()


class PodProcess:
    """One ``lorafleet data-plane`` child process; its stderr (JSON logs) goes to ``log_path``."""

    def __init__(self, workdir: Path, *extra_args: str, name: str = "pod", token: str = POD_TOKEN) -> None:
        self.port = free_port()
        self.metrics_port = free_port()
        self.token = token
        self.token_file = workdir / f"{name}.token"
        self.token_file.write_text(token + "\n")
        self.log_path = workdir / f"{name}.log"
        self.args = ["--host", "127.0.0.1", "--port", str(self.port), "--metrics-port", str(self.metrics_port),
                     "--admin-token-file", str(self.token_file), "--pod-id", name, "--drain-grace", "20",
                     *extra_args]
        self.proc: subprocess.Popen | None = None
        self.channel: grpc.Channel | None = None
        self.health_seen: list[int] = []  # every distinct health status observed while starting

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def start(self, timeout_s: float = 180.0) -> PodProcess:
        self.launch()
        self.wait_serving(timeout_s)
        return self

    def launch(self) -> PodProcess:
        """Starts the process without waiting for it to serve."""
        self.proc = spawn([sys.executable, "-m", "data_plane.server", *self.args], self.log_path, cwd=REPO,
                          env=dict(os.environ, PYTHONUNBUFFERED="1"))
        self.channel = grpc.insecure_channel(self.address)
        return self

    def wait_serving(self, timeout_s: float) -> None:
        wait_serving(self.channel, self.proc, timeout_s, what="pod", log_tail=self.log_tail, observe=self._observe)

    def _observe(self, status: int) -> None:
        if not self.health_seen or self.health_seen[-1] != status:
            self.health_seen.append(status)

    def log_tail(self, n: int = 40) -> str:
        return tail(self.log_path, n)

    def generation(self) -> generation_pb2_grpc.GenerationStub:
        return generation_pb2_grpc.GenerationStub(self.channel)

    def admin(self) -> data_plane_admin_pb2_grpc.DataPlaneAdminStub:
        return data_plane_admin_pb2_grpc.DataPlaneAdminStub(self.channel)

    def auth(self) -> tuple[tuple[str, str]]:
        return (("authorization", f"Bearer {self.token}"),)

    def state(self) -> dpa.PodState:
        return self.admin().GetState(dpa.GetStateRequest(), metadata=self.auth(), timeout=10)

    def metrics(self) -> str:
        return scrape(self.metrics_port)

    def signal(self, sig: int = signal.SIGTERM) -> None:
        self.proc.send_signal(sig)

    def stop(self) -> None:
        if self.channel is not None:
            self.channel.close()
        if self.proc is not None:
            stop_process(self.proc, timeout_s=30)


class ControlPlaneProcess:
    """``python -m control_plane.server`` as a child process."""

    def __init__(self, redis_url: str, token_file: Path, log_dir: Path, replica: str, port: int | None = None,
                 base_model: str = BASE_MODEL, lease_s: float = 1.0, grace_s: float = 1.0) -> None:
        self.port, self.metrics_port = port or free_port(), free_port()
        self.args = [sys.executable, "-m", "control_plane.server", "--redis-url", redis_url, "--host", "127.0.0.1",
                     "--port", str(self.port), "--metrics-port", str(self.metrics_port),
                     "--admin-token-file", str(token_file), "--key-prefix", "it", "--base-model", base_model,
                     "--replica-id", replica, "--pod-lease-ttl", str(lease_s), "--pod-grace", str(grace_s),
                     "--leader-lease-ttl", "1.5", "--reconcile-interval", "0.3"]
        self.log = log_dir / f"{replica}.log"
        self.proc: subprocess.Popen | None = None

    def start(self) -> ControlPlaneProcess:
        self.proc = spawn(self.args, self.log, cwd=REPO)
        wait_listening("127.0.0.1", self.port, self.proc, 30, what="control plane", log_tail=lambda: tail(self.log))
        return self

    def stop(self, sig: int = signal.SIGTERM) -> int:
        return stop_process(self.proc, timeout_s=20, sig=sig) if self.proc else 0

    @property
    def target(self) -> str:
        return f"127.0.0.1:{self.port}"

    def metric(self, name: str) -> float | None:
        for line in scrape(self.metrics_port).splitlines():
            if line.startswith(name + " "):
                return float(line.split()[1])
        return None
