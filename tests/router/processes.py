"""``lorafleet router`` as a child process on loopback, for the tests that drive it over gRPC."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import grpc
from lorafleet.v1 import generation_pb2_grpc

from benchmarks.processes import REPO, free_port, scrape
from cli.up.child_process import spawn, stop_process, tail, wait_serving


class RouterProcess:
    """``python -m router.server`` reading the fleet from ``control_plane``, its OpenAI HTTP API on
    ``http_port``; stderr (JSON logs) goes to ``log_path``."""

    def __init__(self, workdir: Path, control_plane: str, token_file: Path, *extra_args: str) -> None:
        self.port, self.metrics_port, self.http_port = free_port(), free_port(), free_port()
        self.log_path = workdir / "router.log"
        self.args = ["--host", "127.0.0.1", "--port", str(self.port), "--metrics-port", str(self.metrics_port),
                     "--http-port", str(self.http_port),
                     "--control-plane", control_plane, "--admin-token-file", str(token_file), *extra_args]
        self.proc: subprocess.Popen | None = None
        self.channel: grpc.Channel | None = None

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def start(self, timeout_s: float = 30.0) -> RouterProcess:
        self.proc = spawn([sys.executable, "-m", "router.server", *self.args], self.log_path, cwd=REPO,
                          env=dict(os.environ, PYTHONUNBUFFERED="1"))
        self.channel = grpc.insecure_channel(self.address)
        wait_serving(self.channel, self.proc, timeout_s, what="router", log_tail=lambda: tail(self.log_path))
        return self

    @property
    def base_url(self) -> str:
        """The OpenAI API's base URL, as the ``openai`` client takes it."""
        return f"http://127.0.0.1:{self.http_port}/v1"

    def generation(self) -> generation_pb2_grpc.GenerationStub:
        return generation_pb2_grpc.GenerationStub(self.channel)

    def metric(self, name: str, **labels: str) -> float:
        """The value of one sample of the router's /metrics, 0 when absent."""
        want = ",".join(f'{k}="{v}"' for k, v in labels.items())
        key = f"{name}{{{want}}}" if want else name
        for line in scrape(self.metrics_port).splitlines():
            if line.rsplit(" ", 1)[0] == key:
                return float(line.rsplit(" ", 1)[1])
        return 0.0

    def stop(self) -> None:
        if self.channel is not None:
            self.channel.close()
        if self.proc is not None:
            stop_process(self.proc, timeout_s=20)
