"""Ports a server cannot listen on (its own, the plaintext health port) stop the process with the flag named."""

from __future__ import annotations

import asyncio
import socket

import grpc
import pytest
from grpc_health.v1 import health

from conventions.errors import ConfigError
from conventions.health import serve_health_port
from conventions.tls import add_port


@pytest.fixture
def taken_port():
    """A loopback port another socket listens on."""
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        yield taken.getsockname()[1]


def test_a_health_port_already_taken_is_refused_naming_the_flag(taken_port):
    async def start():
        return await serve_health_port(health.aio.HealthServicer(), "127.0.0.1", taken_port)

    with pytest.raises(ConfigError, match=f"--health-port {taken_port}: cannot listen"):
        asyncio.run(start())


def test_a_server_port_already_taken_is_refused_naming_the_flag_that_gave_it(taken_port):
    async def bind():
        add_port(grpc.aio.server(), f"127.0.0.1:{taken_port}", None, "--port")

    with pytest.raises(ConfigError, match=f"--port {taken_port}: cannot listen on 127.0.0.1:{taken_port}"):
        asyncio.run(bind())


def test_port_zero_serves_no_health_port():
    assert asyncio.run(serve_health_port(health.aio.HealthServicer(), "127.0.0.1", 0)) is None
