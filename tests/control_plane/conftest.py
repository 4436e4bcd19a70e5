"""Fixtures for control-plane tests: a real redis-server on loopback (``benchmarks/processes.py``),
tokens, a self-signed TLS certificate, and a control plane served in this process."""

from __future__ import annotations

import asyncio
import contextlib
import shutil
import subprocess
from pathlib import Path

import grpc
import pytest

from benchmarks.processes import TOKEN, RedisServer, free_port
from control_plane.config import ControlPlaneConfig
from conventions.auth import bearer_metadata


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
                              pod_lease_ttl=1.0, pod_grace=1.0, leader_lease_ttl=1.5,
                              reconcile_interval=0.5, replica_id="in-process")


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
