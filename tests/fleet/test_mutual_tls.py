"""Mutual TLS between components, on real processes: a control plane, a pod and a router, each with its own
certificate from one CA and that CA. The fleet works over it (heartbeats, a pin loaded through
DataPlaneAdmin, a request routed, the admin command line); each server refuses, during the TLS handshake,
a client that shows no certificate or one another CA signed, whatever token it sends; a router without a
certificate cannot read the fleet; a plaintext health port answers probes (Kubernetes' gRPC probes cannot speak
TLS) and nothing else; and each process refuses bad TLS flags at start-up, naming the flag."""

from __future__ import annotations

import json
import subprocess
import sys

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from lorafleet.v1 import adapter_admin_pb2 as pb
from lorafleet.v1 import adapter_admin_pb2_grpc as pb_grpc
from lorafleet.v1 import data_plane_admin_pb2 as dpa
from lorafleet.v1 import data_plane_admin_pb2_grpc as dpa_grpc

from benchmarks.processes import REPO, TOKEN, Fleet, RouterProcess, copy_demo_adapters, free_port, wait_until
from conventions.auth import bearer_metadata
from conventions.tls import TlsFiles
from tests.certificates import Authority, handshake
from tests.grpc_helpers import request

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def fleet(tmp_path_factory):
    workdir = tmp_path_factory.mktemp("mtls")
    ca = Authority(workdir, "fleet")
    certs = {name: ca.issue(name) for name in ("control-plane", "pod", "router", "admin")}
    health_ports = {"control-plane": free_port(), "pod": free_port()}
    fleet = Fleet(workdir, copy_demo_adapters(tmp_path_factory.mktemp("mtls-adapters")),
                  *certs["pod"].flags(ca.cert), "--health-port", str(health_ports["pod"]), pods=1,
                  control_plane_args=(*certs["control-plane"].flags(ca.cert),
                                      "--health-port", str(health_ports["control-plane"])),
                  dialer=TlsFiles(certs["admin"].cert, certs["admin"].key, ca.cert).dialer())
    router = None
    try:
        fleet.start()  # the pod registered: its heartbeats pass the control plane's handshake
        fleet.register("pirate")
        fleet.pin("pirate", 1)
        wait_until(lambda: fleet.placements("pirate"), 60, "pirate loaded through the pod's mutual TLS")
        router = RouterProcess(workdir, fleet.cp.target, fleet.token_file, *certs["router"].flags(ca.cert),
                               "--refresh-interval", "0.3").start()
        fleet.health_ports = health_ports
        yield fleet, router, ca, certs
    finally:
        if router is not None:
            router.stop()
        fleet.stop()


def logged(log_path, message: str) -> dict | None:
    """The first JSON log line ``message`` of a process, None while there is none."""
    text = log_path.read_text() if log_path.exists() else ""
    lines = (json.loads(line) for line in text.splitlines() if line.startswith("{"))
    return next((line for line in lines if line.get("msg") == message), None)


def test_a_request_goes_through_the_router_to_the_pod_over_mutual_tls(fleet):
    fleet, router, _, _ = fleet
    wait_until(lambda: router.metric("lorafleet_router_pods_routable") == 1, 10, "the pod read over mutual TLS")
    last = list(router.generation().Generate(request("Ahoy?", "pirate", max_tokens=2), timeout=120))[-1]
    assert last.usage.completion_tokens == 2
    pod = next(iter(fleet.pods.values()))
    cp = logged(fleet.cp.log, "control plane serving")
    assert (cp["tls"], cp["to_pods"]) == ("mtls", "mtls")
    served = logged(pod.log_path, "serving")
    assert (served["tls"], served["to_control_plane"]) == ("mtls", "mtls")
    listening = logged(router.log_path, "router listening")  # the clients' door stays plaintext
    assert (listening["tls"], listening["to_control_plane"], listening["to_pods"]) == ("plaintext", "mtls", "mtls")


def test_each_server_refuses_clients_without_a_certificate_of_its_ca_at_the_handshake(fleet, tmp_path):
    fleet, _, ca, certs = fleet
    pod = next(iter(fleet.pods.values()))
    outsider = Authority(tmp_path, "outsider").issue("outsider")
    for port, name in ((fleet.cp.port, "control-plane"), (pod.port, "pod")):
        assert [handshake(port, ca.cert, shown) for shown in (certs["admin"], None, outsider)] == [
            (name, True), (name, False), (name, False)]


def test_a_valid_token_does_not_get_past_a_refused_handshake(fleet, tmp_path):
    fleet, _, ca, _ = fleet
    pod = next(iter(fleet.pods.values()))
    outsider = Authority(tmp_path, "outsider").issue("outsider")
    codes = []
    for files in (TlsFiles(ca=ca.cert), TlsFiles(outsider.cert, outsider.key, ca.cert), TlsFiles()):
        dialer = files.dialer()
        with dialer.channel(fleet.cp.target) as cp_channel, dialer.channel(pod.address) as pod_channel:
            for call in (lambda: pb_grpc.AdapterAdminStub(cp_channel).ListPods(
                             pb.ListPodsRequest(), metadata=bearer_metadata(TOKEN), timeout=10),
                         lambda: dpa_grpc.DataPlaneAdminStub(pod_channel).GetState(
                             dpa.GetStateRequest(), metadata=bearer_metadata(TOKEN), timeout=10)):
                with pytest.raises(grpc.RpcError) as refused:
                    call()
                codes.append(refused.value.code())
    assert codes == [grpc.StatusCode.UNAVAILABLE] * 6
    assert fleet.pod_ids() == ["pod-a"]  # the same calls with the fleet's certificate pass


def test_the_health_port_answers_probes_in_plaintext_and_serves_nothing_else(fleet):
    fleet, _, _, _ = fleet
    answers = []
    for port in fleet.health_ports.values():
        with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
            health = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=10)
            answers.append(health.status)
            with pytest.raises(grpc.RpcError) as refused:
                pb_grpc.AdapterAdminStub(channel).ListPods(pb.ListPodsRequest(), metadata=bearer_metadata(TOKEN),
                                                           timeout=10)
            answers.append(refused.value.code())
    assert answers == [health_pb2.HealthCheckResponse.SERVING, grpc.StatusCode.UNIMPLEMENTED] * 2


def test_a_router_without_a_certificate_cannot_read_the_fleet(fleet):
    fleet, _, ca, _ = fleet
    router = RouterProcess(fleet.workdir, fleet.cp.target, fleet.token_file, "--tls-ca", str(ca.cert),
                           "--refresh-interval", "0.3", name="router-without-certificate").launch()
    try:
        refused = wait_until(lambda: logged(router.log_path, "cannot read the control plane; routing on the last "
                                                             "registry read"), 30, "the router's refused read")
        assert (refused["code"], logged(router.log_path, "router listening")["to_control_plane"]) == (
            "UNAVAILABLE", "tls")
        status = health_pb2_grpc.HealthStub(router.channel).Check(health_pb2.HealthCheckRequest(), timeout=10).status
        assert status == health_pb2.HealthCheckResponse.NOT_SERVING
    finally:
        router.stop()


def test_the_admin_command_line_needs_its_certificate(fleet):
    fleet, _, ca, certs = fleet

    def adapters(*tls: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-m", "cli.main", "adapters", "list", "--json", "--control-plane",
                               fleet.cp.target, "--token-file", str(fleet.token_file), "--tls-ca", str(ca.cert),
                               *tls], cwd=REPO, capture_output=True, text=True, timeout=60)

    listed = adapters("--tls-cert", str(certs["admin"].cert), "--tls-key", str(certs["admin"].key))
    assert listed.returncode == 0, listed.stderr
    assert [a["name"] for a in json.loads(listed.stdout)] == ["pirate"]
    refused = adapters()
    assert refused.returncode == 1 and refused.stderr.startswith("lorafleet: UNAVAILABLE")


@pytest.mark.parametrize(("command", "flags", "words"), [
    (["control_plane.server", "--redis-url", "redis://127.0.0.1:1/0"], ["--tls-cert", "{admin.pem}"],
     "--tls-cert needs --tls-key"),
    (["control_plane.server", "--redis-url", "redis://127.0.0.1:1/0"], ["--tls-ca", "{fleet-ca.pem}"],
     "--tls-ca needs --tls-cert and --tls-key"),
    (["data_plane.server"], ["--tls-cert", "{admin.pem}", "--tls-key", "{missing.key}"],
     "--tls-key {missing.key}: cannot read it (No such file or directory)"),
    (["data_plane.server"], ["--tls-cert", "{admin.pem}", "--tls-key", "{other.key}"],
     "--tls-key {other.key} is not the PEM private key of --tls-cert {admin.pem}"),
    (["router.server"], ["--tls-cert", "{admin.pem}", "--tls-key", "{admin.key}"],
     "--tls-cert is shown only to peers dialed over TLS: give --tls-ca"),
    (["router.server"], ["--tls-ca", "{admin.key}"], "--tls-ca {admin.key} holds no PEM certificate"),
    (["cli.main", "pods"], ["--tls-ca", "{fleet-ca.pem}", "--tls-cert", "{admin.pem}"], "--tls-cert needs --tls-key"),
])
def test_bad_tls_flags_stop_a_process_at_start_up_naming_the_flag(tmp_path, command, flags, words):
    ca = Authority(tmp_path, "fleet")
    ca.issue("admin")
    ca.issue("other")
    (tmp_path / "token").write_text(TOKEN + "\n")
    paths = {f"{{{p.name}}}": str(p) for p in (*tmp_path.iterdir(), tmp_path / "missing.key")}
    token_flag = "--token-file" if command[0] == "cli.main" else "--admin-token-file"
    argv = [sys.executable, "-m", *command, token_flag, str(tmp_path / "token"), *(fill(f, paths) for f in flags)]
    done = subprocess.run(argv, cwd=REPO, capture_output=True, text=True, timeout=120)
    assert done.returncode != 0
    assert fill(words, paths) in done.stderr, done.stderr


def fill(text: str, paths: dict[str, str]) -> str:
    """``text`` with each ``{file name}`` replaced by that file's path."""
    for placeholder, path in paths.items():
        text = text.replace(placeholder, path)
    return text
