"""DataPlaneAdmin calls to pods, authenticated and fenced, and how the control plane reads their answers."""

from __future__ import annotations

import enum
from dataclasses import dataclass

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from lorafleet.v1 import data_plane_admin_pb2 as pb
from lorafleet.v1 import data_plane_admin_pb2_grpc as pb_grpc

from control_plane.plan import Action, Command
from conventions.auth import bearer_metadata
from conventions.tls import PLAINTEXT, Dialer, Mode


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
_DONE_WHEN_NOT_FOUND = {Command.UNPIN, Command.UNLOAD, Command.RELEASE}


def read_answer(command: Command, code: grpc.StatusCode, details: str = "") -> CommandResult:
    """How the control plane reads a pod's answer ``code`` to ``command``: OK succeeds; NOT_FOUND
    to an unpin or unload succeeds too (the adapter is already gone; the pod's last report was
    behind); ABORTED is a stale fencing token (data_plane StaleCommand), so the sender is
    deposed; every other code fails, with ``details`` as the error (transiently for the codes
    CommandResult.transient names)."""
    if code == grpc.StatusCode.OK or (code == grpc.StatusCode.NOT_FOUND and command in _DONE_WHEN_NOT_FOUND):
        return CommandResult(True)
    return CommandResult(False, code, details or code.name, stale=code == grpc.StatusCode.ABORTED)


class Probe(enum.Enum):
    """What a health check of a silent pod found, and what the control plane concludes."""

    ANSWERED = "answered"  # its server answered (serving or not): alive, its heartbeats are late
    SILENT = "silent"  # no answer in time: paused, overloaded or cut off; its lease decides
    REFUSED = "refused"  # nothing listens at its endpoint (or the name no longer resolves): gone


class PodClients:
    """One channel per pod endpoint, dialed as ``dialer`` says (plaintext, or TLS with this control plane's
    certificate); every command carries the bearer token and the leader's fencing token."""

    def __init__(self, token: str, timeout_s: float, probe_timeout_s: float = 1.0, dialer: Dialer = PLAINTEXT) -> None:
        self._metadata = bearer_metadata(token)
        self._dialer = dialer
        self._timeout_s = timeout_s
        self._probe_timeout_s = probe_timeout_s
        self._channels: dict[str, grpc.aio.Channel] = {}

    def _channel(self, endpoint: str) -> grpc.aio.Channel:
        if endpoint not in self._channels:
            self._channels[endpoint] = self._dialer.aio_channel(endpoint)
        return self._channels[endpoint]

    @property
    def mode(self) -> Mode:
        """How the pods are dialed."""
        return self._dialer.mode

    def _stub(self, endpoint: str) -> pb_grpc.DataPlaneAdminStub:
        return pb_grpc.DataPlaneAdminStub(self._channel(endpoint))

    async def probe(self, endpoint: str) -> Probe:
        """Health-checks the pod at ``endpoint``. A process that has exited leaves its port closed,
        so the connection is refused at once (UNAVAILABLE); a stopped or overloaded process's kernel
        still accepts the connection but nothing answers (DEADLINE_EXCEEDED): the first is REFUSED,
        the second SILENT, and any answer at all ANSWERED."""
        try:
            await health_pb2_grpc.HealthStub(self._channel(endpoint)).Check(
                health_pb2.HealthCheckRequest(), timeout=self._probe_timeout_s)
        except grpc.aio.AioRpcError as e:
            if e.code() == grpc.StatusCode.UNAVAILABLE:
                return Probe.REFUSED
            if e.code() in (grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.CANCELLED):
                return Probe.SILENT
        return Probe.ANSWERED

    async def execute(self, action: Action, fencing_token: int) -> CommandResult:
        """Sends ``action`` to its pod; the answer comes back read by ``read_answer``, never raised."""
        stub, kw = self._stub(action.endpoint), {"metadata": self._metadata, "timeout": self._timeout_s}
        name, token = action.adapter, fencing_token
        try:
            if action.command in (Command.LOAD_AND_PIN, Command.LOAD):
                await stub.LoadAdapter(pb.LoadAdapterRequest(name=name, source=action.source, sha256=action.sha256,
                                                             fencing_token=token), **kw)
            if action.command in (Command.LOAD_AND_PIN, Command.PIN):
                await stub.PinAdapter(pb.PodPinAdapterRequest(name=name, fencing_token=token), **kw)
            elif action.command is Command.UNPIN:
                await stub.UnpinAdapter(pb.PodUnpinAdapterRequest(name=name, fencing_token=token), **kw)
            elif action.command in (Command.UNLOAD, Command.RELEASE):
                await stub.UnloadAdapter(pb.UnloadAdapterRequest(name=name, fencing_token=token), **kw)
            elif action.command is Command.PREFETCH:
                await stub.PrefetchAdapter(pb.PrefetchAdapterRequest(name=name, source=action.source,
                                                                     sha256=action.sha256, fencing_token=token), **kw)
        except grpc.aio.AioRpcError as e:
            return read_answer(action.command, e.code(), e.details())
        return read_answer(action.command, grpc.StatusCode.OK)

    async def forget(self, keep: set[str]) -> None:
        """Closes the channels of endpoints not in ``keep`` (pods that left)."""
        for endpoint in [e for e in self._channels if e not in keep]:
            await self._channels.pop(endpoint).close()

    async def close(self) -> None:
        await self.forget(set())
