"""TLS between components (conventions/tls.py): files that cannot serve are refused when the config is
built, naming the flag; a server given a CA lets in only clients showing a certificate that CA signed,
and refuses the others during the TLS handshake; a renewed certificate is served to new connections
without a restart, and a broken renewal leaves the one in use."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import re

import grpc
import pytest
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from conventions.errors import ConfigError
from conventions.tls import Mode, TlsFiles, add_port
from tests.certificates import Authority, handshake


@pytest.fixture
def fleet_ca(tmp_path) -> Authority:
    return Authority(tmp_path, "fleet")


@pytest.fixture
def other_ca(tmp_path) -> Authority:
    return Authority(tmp_path, "other")


def test_each_file_that_cannot_serve_is_refused_naming_its_flag(fleet_ca, tmp_path):
    server = fleet_ca.issue("server")
    stranger = Authority(tmp_path, "stranger").issue("stranger")
    missing = tmp_path / "missing.pem"
    cases = [
        (dict(cert=server.cert), "--tls-cert needs --tls-key"),
        (dict(key=server.key), "--tls-key needs --tls-cert"),
        (dict(cert=missing, key=server.key), rf"--tls-cert {re.escape(str(missing))}: cannot read it \(No such file"),
        (dict(cert=server.cert, key=tmp_path), r"--tls-key .*: cannot read it \(Is a directory\)"),
        (dict(cert=server.cert, key=stranger.key), "--tls-key .* is not the PEM private key of --tls-cert"),
        (dict(cert=server.key, key=server.key), "--tls-cert .* holds no PEM certificate"),
        (dict(cert=server.cert, key=server.key, ca=server.key), "--tls-ca .* holds no PEM certificate"),
        (dict(ca=missing), r"--tls-ca .*: cannot read it \(No such file or directory\)"),
    ]
    for files, message in cases:
        with pytest.raises(ConfigError, match=message):
            TlsFiles(**files)


def test_the_mode_of_each_link_follows_the_files_given(fleet_ca):
    server = fleet_ca.issue("server")
    assert TlsFiles().serving is Mode.PLAINTEXT and TlsFiles().dialer().mode is Mode.PLAINTEXT
    tls_only = TlsFiles(server.cert, server.key)
    assert tls_only.serving is Mode.TLS and tls_only.dialer().mode is Mode.PLAINTEXT  # no CA: nothing to verify with
    assert tls_only.dialer(fleet_ca.cert.read_bytes()).mode is Mode.MUTUAL
    assert TlsFiles(ca=fleet_ca.cert).dialer().mode is Mode.TLS  # verifies the server, shows no certificate
    mutual = TlsFiles(server.cert, server.key, fleet_ca.cert)
    assert mutual.serving is Mode.MUTUAL and mutual.dialer().mode is Mode.MUTUAL


@contextlib.asynccontextmanager
async def health_server(files: TlsFiles):
    """A gRPC server with only the health service (SERVING), served with ``files``; yields its port."""
    server = grpc.aio.server()
    servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(servicer, server)
    port = add_port(server, "127.0.0.1:0", files.server_credentials())
    await server.start()
    try:
        yield port
    finally:
        await server.stop(None)


async def check(port: int, files: TlsFiles) -> grpc.StatusCode:
    """The code of a health check dialed with ``files``' dialer."""
    async with files.dialer().aio_channel(f"127.0.0.1:{port}") as channel:
        try:
            await health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=5)
        except grpc.aio.AioRpcError as e:
            return e.code()
    return grpc.StatusCode.OK


def test_a_server_given_a_ca_answers_only_clients_showing_a_certificate_it_signed(fleet_ca, other_ca):
    server, client, outsider = fleet_ca.issue("server"), fleet_ca.issue("client"), other_ca.issue("outsider")

    async def go():
        async with health_server(TlsFiles(server.cert, server.key, fleet_ca.cert)) as port:
            codes = [await check(port, files) for files in (
                TlsFiles(client.cert, client.key, fleet_ca.cert),  # a fleet member
                TlsFiles(ca=fleet_ca.cert),  # trusts the server, shows nothing
                TlsFiles(outsider.cert, outsider.key, fleet_ca.cert),  # shows another CA's certificate
                TlsFiles(client.cert, client.key, other_ca.cert))]  # does not trust the server
            handshakes = [await asyncio.to_thread(handshake, port, fleet_ca.cert, shown)
                          for shown in (client, None, outsider)]
            return codes, handshakes

    codes, handshakes = asyncio.run(go())
    assert codes == [grpc.StatusCode.OK] + [grpc.StatusCode.UNAVAILABLE] * 3
    assert handshakes == [("server", True), ("server", False), ("server", False)]


def test_a_server_without_a_ca_serves_tls_to_clients_showing_no_certificate(fleet_ca):
    server = fleet_ca.issue("server")

    async def go():
        async with health_server(TlsFiles(server.cert, server.key)) as port:
            return await check(port, TlsFiles(ca=fleet_ca.cert)), await check(port, TlsFiles())

    assert asyncio.run(go()) == (grpc.StatusCode.OK, grpc.StatusCode.UNAVAILABLE)  # plaintext is not served


def test_a_renewed_certificate_is_served_to_new_connections_and_a_broken_one_is_not(fleet_ca, tmp_path, caplog):
    server, client = fleet_ca.issue("server"), fleet_ca.issue("client")
    files = TlsFiles(server.cert, server.key, fleet_ca.cert)

    async def go():
        async with health_server(files) as port:
            seen = [await asyncio.to_thread(handshake, port, fleet_ca.cert, client)]
            fleet_ca.issue("server-renewed", cert=server.cert, key=server.key)
            seen.append(await asyncio.to_thread(handshake, port, fleet_ca.cert, client))
            # A half-done renewal: the new certificate beside the old key. The renewed pair stays in use.
            Authority(tmp_path, "half").issue("server-broken", cert=server.cert, key=tmp_path / "unused.key")
            seen.append(await asyncio.to_thread(handshake, port, fleet_ca.cert, client))
            return seen

    with caplog.at_level(logging.INFO, logger="lorafleet.tls"):
        seen = asyncio.run(go())
    assert seen == [("server", True), ("server-renewed", True), ("server-renewed", True)]
    assert [r.getMessage() for r in caplog.records] == [
        "TLS files changed; new connections use them",
        "TLS files changed but cannot be used; new connections keep the previous ones"]
