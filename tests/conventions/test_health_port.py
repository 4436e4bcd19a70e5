"""The plaintext health port: a port it cannot listen on stops the process with the flag named."""

from __future__ import annotations

import asyncio
import socket

import pytest
from grpc_health.v1 import health

from conventions.errors import ConfigError
from conventions.health import serve_health_port


def test_a_health_port_already_taken_is_refused_naming_the_flag():
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]

        async def start():
            return await serve_health_port(health.aio.HealthServicer(), "127.0.0.1", port)

        with pytest.raises(ConfigError, match=f"--health-port {port}: cannot listen"):
            asyncio.run(start())


def test_port_zero_serves_no_health_port():
    assert asyncio.run(serve_health_port(health.aio.HealthServicer(), "127.0.0.1", 0)) is None
