"""How the control plane reads a pod's answers: the rules in ``read_answer``, and PodClients
applying them to a real DataPlaneAdmin server on loopback that answers with scripted codes; how
its health probe tells a pod that answers, one that is silent and one that is gone apart."""

from __future__ import annotations

import asyncio
import socket

import grpc
import pytest
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from lorafleet.v1 import data_plane_admin_pb2 as pb
from lorafleet.v1 import data_plane_admin_pb2_grpc as pb_grpc

from benchmarks.processes import TOKEN
from control_plane.plan import Action, Command
from control_plane.pod_client import PodClients, Probe, read_answer

C = grpc.StatusCode


@pytest.mark.parametrize(("command", "code", "ok", "stale", "transient"), [
    (Command.LOAD_AND_PIN, C.OK, True, False, False),
    (Command.UNPIN, C.NOT_FOUND, True, False, False),  # already unpinned: done
    (Command.UNLOAD, C.NOT_FOUND, True, False, False),  # already unloaded: done
    (Command.PIN, C.NOT_FOUND, False, False, False),  # an adapter that is not there is not pinned
    (Command.LOAD_AND_PIN, C.NOT_FOUND, False, False, False),
    (Command.UNPIN, C.ABORTED, False, True, False),  # a newer fencing token: the sender is deposed
    (Command.LOAD_AND_PIN, C.INVALID_ARGUMENT, False, False, False),
    (Command.UNLOAD, C.FAILED_PRECONDITION, False, False, False),
    (Command.PIN, C.UNAVAILABLE, False, False, True),
    (Command.LOAD_AND_PIN, C.DEADLINE_EXCEEDED, False, False, True),
    (Command.UNPIN, C.UNAUTHENTICATED, False, False, True),
])
def test_each_answer_is_read_by_one_rule(command, code, ok, stale, transient):
    result = read_answer(command, code, "why")
    assert (result.ok, result.stale, result.transient) == (ok, stale, transient)
    assert result.error == ("" if ok else "why")


def test_a_failure_without_details_names_its_code():
    assert read_answer(Command.PIN, C.RESOURCE_EXHAUSTED).error == "RESOURCE_EXHAUSTED"


class ScriptedPod(pb_grpc.DataPlaneAdminServicer):
    """Answers each DataPlaneAdmin method with the code ``answers`` gives it (OK when absent)."""

    def __init__(self, answers: dict[str, grpc.StatusCode]) -> None:
        self.answers = answers

    async def _answer(self, method: str, reply, context):
        code = self.answers.get(method, C.OK)
        if code != C.OK:
            await context.abort(code, f"{method} answered {code.name}")
        return reply

    async def LoadAdapter(self, request, context):
        return await self._answer("LoadAdapter", pb.AdapterResidency(), context)

    async def PinAdapter(self, request, context):
        return await self._answer("PinAdapter", pb.AdapterResidency(), context)

    async def UnpinAdapter(self, request, context):
        return await self._answer("UnpinAdapter", pb.AdapterResidency(), context)

    async def UnloadAdapter(self, request, context):
        return await self._answer("UnloadAdapter", pb.UnloadAdapterResponse(), context)


def execute_against(answers: dict[str, grpc.StatusCode], *commands: Command):
    """The results of sending ``commands`` through PodClients to a ScriptedPod on loopback."""
    async def go():
        server = grpc.aio.server()
        pb_grpc.add_DataPlaneAdminServicer_to_server(ScriptedPod(answers), server)
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        clients = PodClients(TOKEN, timeout_s=5.0)
        try:
            return [await clients.execute(Action("p0", f"127.0.0.1:{port}", c, "a", "file:///a", "ab" * 32), 1)
                    for c in commands]
        finally:
            await clients.close()
            await server.stop(None)

    return asyncio.run(go())


def test_an_unpin_or_unload_the_pod_answers_not_found_is_done():
    unpin, unload = execute_against({"UnpinAdapter": C.NOT_FOUND, "UnloadAdapter": C.NOT_FOUND},
                                    Command.UNPIN, Command.UNLOAD)
    assert unpin.ok and unload.ok


def test_an_extra_replica_is_loaded_without_a_pin_and_released_by_an_unload():
    # a pin would be refused here: a LOAD that sent one would fail
    load, release, gone, in_use = (
        *execute_against({"PinAdapter": C.RESOURCE_EXHAUSTED}, Command.LOAD, Command.RELEASE),
        *execute_against({"UnloadAdapter": C.NOT_FOUND}, Command.RELEASE),
        *execute_against({"UnloadAdapter": C.FAILED_PRECONDITION}, Command.RELEASE))
    assert load.ok and release.ok
    assert gone.ok  # already gone from the pod: done
    assert (in_use.ok, in_use.transient, in_use.code) == (False, False, C.FAILED_PRECONDITION)


def test_a_pin_the_pod_answers_not_found_fails_with_the_pods_reason():
    [pin] = execute_against({"PinAdapter": C.NOT_FOUND}, Command.PIN)
    assert (pin.ok, pin.code, pin.error) == (False, C.NOT_FOUND, "PinAdapter answered NOT_FOUND")


def test_a_stale_fencing_token_comes_back_stale_and_a_pods_acceptance_ok():
    stale, loaded = execute_against({"UnloadAdapter": C.ABORTED}, Command.UNLOAD, Command.LOAD_AND_PIN)
    assert stale.stale and not stale.ok
    assert loaded.ok


def probe(endpoint: str) -> Probe:
    async def go():
        clients = PodClients(TOKEN, timeout_s=5.0, probe_timeout_s=0.5)
        try:
            return await clients.probe(endpoint)
        finally:
            await clients.close()

    return asyncio.run(go())


@pytest.mark.parametrize("status", [health_pb2.HealthCheckResponse.SERVING, health_pb2.HealthCheckResponse.NOT_SERVING])
def test_a_pod_whose_server_answers_its_health_check_is_alive(status):
    async def go():
        server = grpc.aio.server()
        servicer = health.aio.HealthServicer()
        await servicer.set("", status)
        health_pb2_grpc.add_HealthServicer_to_server(servicer, server)
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        clients = PodClients(TOKEN, timeout_s=5.0, probe_timeout_s=0.5)
        try:
            return await clients.probe(f"127.0.0.1:{port}")
        finally:
            await clients.close()
            await server.stop(None)

    assert asyncio.run(go()) is Probe.ANSWERED


def test_a_pod_whose_port_refuses_the_connection_is_gone():
    with socket.socket() as s:  # a port that was free a moment ago: nothing listens there
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    assert probe(f"127.0.0.1:{port}") is Probe.REFUSED


def test_a_pod_that_accepts_the_connection_but_never_answers_is_silent_not_gone():
    # what a stopped (SIGSTOP) or wedged process looks like: the kernel completes the TCP handshake
    # from the listen backlog, and nothing ever speaks HTTP/2
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen(8)
        assert probe(f"127.0.0.1:{s.getsockname()[1]}") is Probe.SILENT
