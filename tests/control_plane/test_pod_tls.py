"""A pod dials a control plane that serves TLS (served in this process, on loopback): trusting the
control plane's certificate through --control-plane-ca its heartbeats are accepted; without that
flag, or trusting another certificate, they fail, and the pod's failure log says how it dialled."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import logging

import grpc
import pytest
from lorafleet.v1 import adapter_admin_pb2 as pb
from lorafleet.v1 import adapter_admin_pb2_grpc as pb_grpc
from lorafleet.v1 import data_plane_admin_pb2 as dpa

from benchmarks.processes import TOKEN
from data_plane.config import DataPlaneConfig, add_arguments
from data_plane.membership import MembershipClient
from tests.control_plane.conftest import auth, self_signed_cert


def pod_config(control_plane: str, token_file, *extra: str) -> DataPlaneConfig:
    """The pod's config as ``lorafleet data-plane`` builds it from these flags."""
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    args = parser.parse_args(["--control-plane", control_plane, "--admin-token-file", str(token_file), *extra])
    return DataPlaneConfig.from_args(args)


def membership(pod: DataPlaneConfig, pod_id: str) -> MembershipClient:
    return MembershipClient(pod.control_plane, TOKEN, pod_id, "127.0.0.1:1", "", dpa.PodState,
                            dialer=pod.control_plane_dialer(), rpc_timeout_s=2.0, max_backoff_s=0.2)


@contextlib.asynccontextmanager
async def tls_control_plane(config, cert, key):
    """Serves ``config`` with TLS in this event loop; yields an AdapterAdmin stub that trusts ``cert``."""
    from control_plane.server import serve

    config = dataclasses.replace(config, tls_cert=cert, tls_key=key)
    stop = asyncio.Event()
    task = asyncio.create_task(serve(config, stop))
    creds = grpc.ssl_channel_credentials(root_certificates=cert.read_bytes())
    try:
        async with grpc.aio.secure_channel(f"127.0.0.1:{config.port}", creds) as channel:
            await asyncio.wait_for(channel.channel_ready(), timeout=10)
            yield pb_grpc.AdapterAdminStub(channel)
    finally:
        stop.set()
        await asyncio.wait_for(task, timeout=15)


async def listed(admin: pb_grpc.AdapterAdminStub) -> list[str]:
    return [p.id for p in (await admin.ListPods(pb.ListPodsRequest(), metadata=auth())).pods]


def test_a_pod_given_the_control_planes_certificate_heartbeats_over_tls(config, tls_files, token_file):
    cert, key = tls_files
    pod = pod_config(f"127.0.0.1:{config.port}", token_file, "--control-plane-ca", str(cert))

    async def go():
        async with tls_control_plane(config, cert, key) as admin:
            client = membership(pod, "pod-tls")
            try:
                response = await client.heartbeat()
            finally:
                await client.close()
            return response.lease_ttl_seconds, await listed(admin)

    lease, pods = asyncio.run(go())
    assert lease == config.pod_lease_ttl
    assert pods == ["pod-tls"]


def test_a_pod_without_the_ca_flag_dials_in_plaintext_fails_and_logs_that_it_did(config, tls_files, token_file,
                                                                                caplog):
    cert, key = tls_files
    pod = pod_config(f"127.0.0.1:{config.port}", token_file)

    async def go():
        async with tls_control_plane(config, cert, key) as admin:
            client = membership(pod, "pod-plain")
            with pytest.raises(grpc.aio.AioRpcError) as refused:
                await client.heartbeat()
            task = asyncio.create_task(client.run())  # closes the client when cancelled
            await asyncio.sleep(0.5)
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
            return refused.value.code(), await listed(admin)

    with caplog.at_level(logging.WARNING, logger="data_plane.membership"):
        code, pods = asyncio.run(go())
    assert code == grpc.StatusCode.UNAVAILABLE
    assert pods == []
    failures = [r for r in caplog.records if r.getMessage() == "heartbeat to control plane failed"]
    assert failures and failures[0].tls is False and failures[0].code == "UNAVAILABLE"


def test_a_pod_trusting_another_certificate_refuses_the_control_plane(config, tls_files, token_file, tmp_path):
    cert, key = tls_files
    other, _ = self_signed_cert(tmp_path, "other")
    pod = pod_config(f"127.0.0.1:{config.port}", token_file, "--control-plane-ca", str(other))

    async def go():
        async with tls_control_plane(config, cert, key) as admin:
            client = membership(pod, "pod-other-ca")
            try:
                with pytest.raises(grpc.aio.AioRpcError) as refused:
                    await client.heartbeat()
            finally:
                await client.close()
            return refused.value, await listed(admin)

    refused, pods = asyncio.run(go())
    assert refused.code() == grpc.StatusCode.UNAVAILABLE
    assert "CERTIFICATE_VERIFY_FAILED" in refused.details()
    assert pods == []
