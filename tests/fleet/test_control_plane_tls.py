"""Real processes on loopback: a control plane serving TLS with a self-signed certificate, a pod
started with --control-plane-ca naming that certificate, and a pod started without it."""

from __future__ import annotations

import json

import grpc
import pytest
from lorafleet.v1 import adapter_admin_pb2 as pb
from lorafleet.v1 import adapter_admin_pb2_grpc as pb_grpc

from benchmarks.processes import FLEET_BASE_MODEL, TOKEN, ControlPlaneProcess, PodProcess, RedisServer, wait_until
from tests.control_plane.conftest import auth, self_signed_cert

pytestmark = pytest.mark.slow

POD_ARGS = ("--heartbeat-interval", "0.3", "--max-loras", "1", "--max-cpu-loras", "1", "--max-num-seqs", "1",
            "--num-kv-blocks", "16")


def plaintext_heartbeat_failures(pod: PodProcess) -> list[dict]:
    lines = (json.loads(line) for line in pod.log_path.read_text().splitlines() if line.startswith("{"))
    return [e for e in lines if e.get("msg") == "heartbeat to control plane failed" and e.get("tls") is False]


def test_a_pod_with_the_control_planes_ca_joins_over_tls_and_one_without_it_does_not(demo_model_dir, tmp_path):
    cert, key = self_signed_cert(tmp_path)
    redis = RedisServer(tmp_path)
    token_file = tmp_path / "token"
    token_file.write_text(TOKEN + "\n")
    cp, pods, channel = None, [], None
    try:
        redis.start()
        cp = ControlPlaneProcess(redis.url, token_file, tmp_path, "cp", base_model=FLEET_BASE_MODEL)
        cp.args += ["--tls-cert", str(cert), "--tls-key", str(key)]
        cp.start()
        trusted = PodProcess(tmp_path, "--control-plane", cp.target, "--control-plane-ca", str(cert), *POD_ARGS,
                             name="pod-tls", token=TOKEN).launch()
        plain = PodProcess(tmp_path, "--control-plane", cp.target, *POD_ARGS, name="pod-plain", token=TOKEN).launch()
        pods = [trusted, plain]
        for pod in pods:
            pod.wait_serving(180)
        channel = grpc.secure_channel(cp.target, grpc.ssl_channel_credentials(root_certificates=cert.read_bytes()))
        admin = pb_grpc.AdapterAdminStub(channel)

        def listed() -> list[str]:
            return [p.id for p in admin.ListPods(pb.ListPodsRequest(), metadata=auth(), timeout=5).pods]

        wait_until(lambda: "pod-tls" in listed(), timeout_s=20, what="pod-tls registered over TLS")
        failures = wait_until(lambda: plaintext_heartbeat_failures(plain), timeout_s=20,
                              what="pod-plain logging its failed plaintext heartbeat")
        assert failures[0]["code"] == "UNAVAILABLE"
        assert listed() == ["pod-tls"]
    finally:
        if channel is not None:
            channel.close()
        for pod in pods:
            pod.stop()
        if cp is not None:
            cp.stop()
        redis.kill()
