"""DataPlaneAdmin calls to pods, authenticated and fenced, and how the control plane reads their answers."""

from __future__ import annotations

from dataclasses import dataclass

import grpc
from lorafleet.v1 import data_plane_admin_pb2 as pb
from lorafleet.v1 import data_plane_admin_pb2_grpc as pb_grpc

from control_plane.plan import Action, Command
from conventions.auth import bearer_metadata


@dataclass(frozen=True)
class CommandResult:
    ok: bool
    code: grpc.StatusCode = grpc.StatusCode.OK
    error: str = ""
    stale: bool = False  # the pod has seen a newer fencing token: this replica is deposed

    @property
    def transient(self) -> bool:
        """The pod did not judge the command (unreachable, timed out, or refused our token):
        not the adapter's fault, so it does not count as a failed load."""
        return self.code in _TRANSIENT


_TRANSIENT = {grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.CANCELLED,
              grpc.StatusCode.UNAUTHENTICATED}

# Unpinning or unloading an adapter the pod no longer holds leaves the pod as asked.
_DONE_WHEN_NOT_FOUND = {Command.UNPIN, Command.UNLOAD}


def read_answer(command: Command, code: grpc.StatusCode, details: str = "") -> CommandResult:
    """How the control plane reads a pod's answer ``code`` to ``command``: OK succeeds; NOT_FOUND
    to an unpin or unload succeeds too (the adapter is already gone; the pod's last report was
    behind); ABORTED is a stale fencing token (data_plane StaleCommand), so the sender is
    deposed; every other code fails, with ``details`` as the error (transiently for the codes
    CommandResult.transient names)."""
    if code == grpc.StatusCode.OK or (code == grpc.StatusCode.NOT_FOUND and command in _DONE_WHEN_NOT_FOUND):
        return CommandResult(True)
    return CommandResult(False, code, details or code.name, stale=code == grpc.StatusCode.ABORTED)


class PodClients:
    """One channel per pod endpoint; every command carries the bearer token and the leader's
    fencing token."""

    def __init__(self, token: str, timeout_s: float) -> None:
        self._metadata = bearer_metadata(token)
        self._timeout_s = timeout_s
        self._channels: dict[str, grpc.aio.Channel] = {}

    def _stub(self, endpoint: str) -> pb_grpc.DataPlaneAdminStub:
        if endpoint not in self._channels:
            self._channels[endpoint] = grpc.aio.insecure_channel(endpoint)
        return pb_grpc.DataPlaneAdminStub(self._channels[endpoint])

    async def execute(self, action: Action, fencing_token: int) -> CommandResult:
        """Sends ``action`` to its pod; the answer comes back read by ``read_answer``, never raised."""
        stub, kw = self._stub(action.endpoint), {"metadata": self._metadata, "timeout": self._timeout_s}
        name, token = action.adapter, fencing_token
        try:
            if action.command is Command.LOAD_AND_PIN:
                await stub.LoadAdapter(pb.LoadAdapterRequest(name=name, source=action.source, sha256=action.sha256,
                                                             fencing_token=token), **kw)
                await stub.PinAdapter(pb.PodPinAdapterRequest(name=name, fencing_token=token), **kw)
            elif action.command is Command.PIN:
                await stub.PinAdapter(pb.PodPinAdapterRequest(name=name, fencing_token=token), **kw)
            elif action.command is Command.UNPIN:
                await stub.UnpinAdapter(pb.PodUnpinAdapterRequest(name=name, fencing_token=token), **kw)
            else:
                await stub.UnloadAdapter(pb.UnloadAdapterRequest(name=name, fencing_token=token), **kw)
        except grpc.aio.AioRpcError as e:
            return read_answer(action.command, e.code(), e.details())
        return read_answer(action.command, grpc.StatusCode.OK)

    async def forget(self, keep: set[str]) -> None:
        """Closes the channels of endpoints not in ``keep`` (pods that left)."""
        for endpoint in [e for e in self._channels if e not in keep]:
            await self._channels.pop(endpoint).close()

    async def close(self) -> None:
        await self.forget(set())
