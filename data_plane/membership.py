"""The pod's side of fleet membership: heartbeats to the control plane, adapter-name
resolution, and the fencing guard that refuses commands from a deposed control-plane leader."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
from collections.abc import Callable

import grpc
from lorafleet.v1 import data_plane_admin_pb2, membership_pb2, membership_pb2_grpc

from conventions.auth import bearer_metadata
from conventions.tls import PLAINTEXT, Dialer, Mode
from data_plane.demand import DemandMeter
from data_plane.errors import AdapterNotFound, ControlPlaneUnavailable, StaleCommand

log = logging.getLogger(__name__)

# Reconnect quickly once the control plane is back (gRPC's default backoff grows to 120 s).
_CHANNEL_OPTIONS = (("grpc.initial_reconnect_backoff_ms", 500), ("grpc.min_reconnect_backoff_ms", 500),
                    ("grpc.max_reconnect_backoff_ms", 5000))


class FencingGuard:
    """The newest control-plane fencing token this pod has seen. Commands carrying an older
    token come from a leader that has since been replaced, and are refused."""

    def __init__(self) -> None:
        self._newest = 0

    @property
    def newest(self) -> int:
        return self._newest

    def observe(self, token: int) -> None:
        """Raises the newest token to ``token`` if it is newer."""
        self._newest = max(self._newest, token)

    def check(self, token: int) -> None:
        """Accepts a command's ``token`` (and remembers it) unless it is older than the newest seen."""
        if token < self._newest:
            raise StaleCommand(f"fencing token {token} is older than {self._newest}: the command comes from a "
                               "control-plane replica that is no longer the leader; it is ignored")
        self.observe(token)


class MembershipClient:
    """Keeps the pod in the fleet: ``run()`` heartbeats until cancelled (riding out control-plane
    restarts with backoff), and ``resolve()`` asks where an adapter's weights live."""

    def __init__(self, control_plane: str, token: str, pod_id: str, endpoint: str, base_model: str,
                 get_state: Callable[[], data_plane_admin_pb2.PodState], interval_s: float = 3.0, *,
                 guard: FencingGuard | None = None, is_ready: Callable[[], bool] = lambda: True,
                 dialer: Dialer = PLAINTEXT, rpc_timeout_s: float = 5.0, max_backoff_s: float = 10.0,
                 demand: DemandMeter | None = None, demand_report_top: int = 32) -> None:
        if interval_s <= 0:
            raise ValueError(f"interval_s must be positive, got {interval_s}")
        self.guard = guard or FencingGuard()
        self.lease_ttl_s = 0.0  # as the control plane last granted it; 0 before the first heartbeat
        self._target = control_plane
        self._metadata = bearer_metadata(token)
        self._pod_id, self._endpoint, self._base_model = pod_id, endpoint, base_model
        self._get_state, self._is_ready = get_state, is_ready
        self._demand, self._demand_top = demand, demand_report_top
        self._interval_s, self._rpc_timeout_s, self._max_backoff_s = interval_s, rpc_timeout_s, max_backoff_s
        # Logged with each failure: a plaintext dial to a TLS control plane fails as just "Socket closed".
        self._tls = dialer.mode is not Mode.PLAINTEXT
        self._channel = dialer.aio_channel(control_plane, options=_CHANNEL_OPTIONS)
        self._stub = membership_pb2_grpc.PodMembershipStub(self._channel)

    async def heartbeat(self, ready: bool | None = None) -> membership_pb2.HeartbeatResponse:
        """Sends one heartbeat and records the lease and fencing token it returns."""
        state = self._get_state()
        request = membership_pb2.HeartbeatRequest(pod_id=self._pod_id, endpoint=self._endpoint,
                                                  base_model=self._base_model, state=state,
                                                  ready=self._is_ready() if ready is None else ready,
                                                  demand=demand_pb(self._demand, self._demand_top))
        response = await self._stub.Heartbeat(request, metadata=self._metadata, timeout=self._rpc_timeout_s)
        self.guard.observe(response.fencing_token)
        self.lease_ttl_s = response.lease_ttl_seconds
        return response

    async def run(self) -> None:
        """Heartbeats until cancelled; on cancellation says goodbye (ready=false) and closes."""
        failures = 0
        try:
            while True:
                try:
                    await self.heartbeat()
                except grpc.aio.AioRpcError as e:
                    failures += 1
                    if failures == 1 or failures % 10 == 0:
                        log.warning("heartbeat to control plane failed", extra={
                            "control_plane": self._target, "tls": self._tls, "code": e.code().name,
                            "error": e.details(), "failures": failures})
                    # Exponential backoff with jitter, so a restarted control plane is not stampeded.
                    delay = min(self._max_backoff_s, 0.5 * 2 ** min(failures, 10)) * random.uniform(0.8, 1.2)
                    await asyncio.sleep(delay)
                    continue
                if failures:
                    log.info("heartbeat to control plane restored", extra={"control_plane": self._target})
                failures = 0
                interval = self._interval_s
                if self.lease_ttl_s > 0:
                    interval = min(interval, self.lease_ttl_s / 3)  # two beats may be lost within a lease
                await asyncio.sleep(interval)
        finally:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(self.heartbeat(ready=False), timeout=1.0)
            await self._channel.close()

    async def resolve(self, name: str) -> tuple[str, str]:
        """(source, sha256) of a registered adapter; AdapterNotFound when it is not registered,
        ControlPlaneUnavailable when the control plane cannot answer."""
        try:
            r = await self._stub.ResolveAdapter(membership_pb2.ResolveAdapterRequest(name=name),
                                                metadata=self._metadata, timeout=self._rpc_timeout_s)
        except grpc.aio.AioRpcError as e:
            if e.code() == grpc.StatusCode.NOT_FOUND:
                raise AdapterNotFound(f"adapter {name!r} is not registered with the control plane; "
                                      "register it (lorafleet adapters register) or fix the name") from e
            if e.code() == grpc.StatusCode.INVALID_ARGUMENT:
                raise AdapterNotFound(f"{e.details()}") from e
            raise ControlPlaneUnavailable(f"cannot resolve adapter {name!r}: control plane {self._target} answered "
                                          f"{e.code().name} ({e.details()}); retry later") from e
        return r.source, r.sha256

    async def close(self) -> None:
        await self._channel.close()


def demand_pb(meter: DemandMeter | None, top: int) -> membership_pb2.AdapterDemand:
    """The heartbeat's demand report: the ``top`` busiest adapters by rate, the rest summed (empty without a meter)."""
    if meter is None:
        return membership_pb2.AdapterDemand()
    r = meter.report(top)
    return membership_pb2.AdapterDemand(
        window_seconds=r.window_s, other_rate=r.other_rate, adapters_tracked=r.tracked,
        rates=[membership_pb2.AdapterRate(adapter=a, requests_per_second=rate) for a, rate in r.top])
