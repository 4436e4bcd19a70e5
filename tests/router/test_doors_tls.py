"""The clients' doors over TLS: a real router process in front of the package's fleet serves gRPC and the
OpenAI HTTP API with --door-tls-cert; the official ``openai`` client and grpc stubs verify it against the CA
that signed it; a renewed certificate is served to new connections without a restart; a certificate
that cannot serve is refused at start-up naming its flag, and a broken renewal keeps the last good one."""

from __future__ import annotations

import socket
import ssl
import subprocess
import sys

import grpc
import httpx2 as httpx
import openai
import pytest
from cryptography import x509
from grpc_health.v1 import health_pb2, health_pb2_grpc

from benchmarks.processes import REPO, RouterProcess, free_port, wait_until
from tests.certificates import Authority
from tests.grpc_helpers import collect, request

pytestmark = pytest.mark.slow


def served_serial(port: int, ca) -> int:
    """The serial number of the certificate a new TLS connection to 127.0.0.1:``port`` is shown."""
    context = ssl.create_default_context(cafile=str(ca))
    with socket.create_connection(("127.0.0.1", port), timeout=10) as raw, \
            context.wrap_socket(raw, server_hostname="127.0.0.1") as tls:
        return x509.load_der_x509_certificate(tls.getpeercert(binary_form=True)).serial_number


@pytest.fixture(scope="module")
def door(stack, tmp_path_factory):
    """(router whose doors serve TLS, the doors' CA, the certificate's files)."""
    fleet, _, _ = stack
    workdir = tmp_path_factory.mktemp("door-tls")
    public = Authority(workdir, "public")
    issued = public.issue("router-door")
    health = free_port()
    router = RouterProcess(workdir, fleet.cp.target, fleet.token_file, "--refresh-interval", "0.3",
                           "--door-tls-cert", str(issued.cert), "--door-tls-key", str(issued.key),
                           "--health-port", str(health), door_ca=public.cert).start()
    router.health_port = health
    wait_until(lambda: router.metric("lorafleet_router_pods_routable") == 2, 30, "the router's first read")
    yield router, public, issued
    router.stop()


def test_both_doors_serve_tls_that_the_official_clients_verify(door):
    router, public, _ = door
    assert collect(router, request("Where is the treasure?", "pirate", max_tokens=4))[2].usage.completion_tokens
    with openai.OpenAI(base_url=router.base_url, api_key="unused", max_retries=0, timeout=120,
                       http_client=httpx.Client(verify=ssl.create_default_context(cafile=str(public.cert)))) as client:
        reply = client.chat.completions.create(model="pirate", max_tokens=4,
                                               messages=[{"role": "user", "content": "Ahoy?"}])
        assert reply.choices[0].message.content and router.base_url.startswith("https://")
    done = subprocess.run([sys.executable, "-m", "cli.main", "generate", "--endpoint", router.address, "--tls-ca",
                           str(public.cert), "--adapter", "pirate", "--max-tokens", "2", "Ahoy?"], cwd=REPO,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and done.stdout.strip(), done.stderr  # lorafleet generate over the TLS door
    with pytest.raises(httpx.TransportError):  # plaintext HTTP to a TLS door gets no answer
        httpx.get(f"http://127.0.0.1:{router.http_port}/v1/models", timeout=10)
    with grpc.insecure_channel(router.address) as plain, pytest.raises(grpc.RpcError):
        list(plain.unary_stream("/lorafleet.v1.Generation/Generate")(b"", timeout=5))
    # probes that cannot speak TLS ask the plaintext health port, which serves nothing else
    with grpc.insecure_channel(f"127.0.0.1:{router.health_port}") as plain:
        status = health_pb2_grpc.HealthStub(plain).Check(health_pb2.HealthCheckRequest(), timeout=5).status
        assert status == health_pb2.HealthCheckResponse.SERVING
        with pytest.raises(grpc.RpcError) as e:
            list(plain.unary_stream("/lorafleet.v1.Generation/Generate")(b"", timeout=5))
        assert e.value.code() == grpc.StatusCode.UNIMPLEMENTED


def test_a_renewed_certificate_reaches_new_connections_and_a_broken_one_keeps_the_last_good(door):
    router, public, issued = door
    before = {port: served_serial(port, public.cert) for port in (router.port, router.http_port)}
    renewed = public.issue("router-door", issued.cert, issued.key)
    serial = x509.load_pem_x509_certificate(renewed.cert.read_bytes()).serial_number
    for port in before:
        wait_until(lambda p=port: served_serial(p, public.cert) == serial, 20, f"the renewed certificate on {port}")
    assert serial not in before.values()
    issued.key.write_text("not a key\n")  # a renewal caught half-written
    assert served_serial(router.http_port, public.cert) == serial
    assert collect(router, request("Still there?", "pirate", max_tokens=2))[2].usage.completion_tokens


def test_a_key_that_does_not_match_its_certificate_stops_the_router_at_start_up_naming_the_flag(tmp_path):
    public = Authority(tmp_path, "public")
    one, other = public.issue("one"), public.issue("other")
    token = tmp_path / "token"
    token.write_text("t" * 32)
    done = subprocess.run([sys.executable, "-m", "router.server", "--admin-token-file", str(token),
                           "--door-tls-cert", str(one.cert), "--door-tls-key", str(other.key)],
                          cwd=REPO, capture_output=True, text=True, timeout=60)
    assert done.returncode != 0 and "--door-tls-key" in done.stderr and "--door-tls-cert" in done.stderr
