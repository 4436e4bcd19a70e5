"""Keeps the router's FleetView fresh: every refresh interval it reads the registry and the pod list
from the control plane, and each ready pod's health and GetState, in the background. Requests only
read ``view``; none waits on these calls."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from lorafleet.v1 import adapter_admin_pb2 as admin_pb
from lorafleet.v1 import adapter_admin_pb2_grpc, data_plane_admin_pb2_grpc
from lorafleet.v1 import data_plane_admin_pb2 as pod_pb

from conventions.auth import bearer_metadata
from router.channels import PodChannels
from router.config import RouterConfig
from router.metrics import RouterMetrics
from router.view import FleetView, build_view

log = logging.getLogger("lorafleet.router.state")

_PAGE_SIZE = 1000  # the largest page ListAdapters serves
_GENERATION = "lorafleet.v1.Generation"


class StateRefresher:
    """Holds the latest FleetView (None until the first read of the control plane succeeds). When the
    control plane cannot be read, the last registry and pod list stay in use and the pods are still
    re-read, so that a dead or draining pod leaves the view within one interval either way."""

    def __init__(self, config: RouterConfig, token: str, channels: PodChannels, metrics: RouterMetrics) -> None:
        self._config, self._channels, self._metrics = config, channels, metrics
        self._metadata = bearer_metadata(token)
        self._cp_channel = config.control_plane_dialer().aio_channel(config.control_plane)
        self._admin = adapter_admin_pb2_grpc.AdapterAdminStub(self._cp_channel)
        self._registry: tuple[list[admin_pb.Adapter], list[admin_pb.Pod]] | None = None
        self._cp_failing = False
        self.view: FleetView | None = None
        self.first_read = asyncio.Event()

    async def run(self, stop: asyncio.Event) -> None:
        """Refreshes every interval until ``stop`` is set."""
        while not stop.is_set():
            started = time.monotonic()
            try:
                await self.refresh()
            except Exception:  # noqa: BLE001 - a failed read must not stop every later one
                log.exception("refreshing the fleet view failed; keeping the last view")
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(stop.wait(), max(0.0, self._config.refresh_interval -
                                                        (time.monotonic() - started)))

    async def refresh(self) -> None:
        """One read of the control plane and every ready pod; replaces ``view``."""
        read_at = time.monotonic()
        await self._read_registry()
        if self._registry is None:
            return
        adapters, pods = self._registry
        ready = [p for p in pods if p.ready]
        states = await asyncio.gather(*(self._read_pod(p) for p in ready))
        known = self.view.base_model if self.view else ""
        self.view = build_view(adapters, pods, {p.id: s for p, s in zip(ready, states, strict=True) if s}, read_at,
                               known)
        self._channels.keep_only({p.endpoint for p in pods})
        self._metrics.pods_routable.set(len(self.view.pods))
        remote = set(self.view.remote.values())
        self._metrics.disk_copies.set(sum(len(p.disk & remote) for p in self.view.pods))
        self._metrics.adapters_registered.set(len(self.view.adapters))
        self.first_read.set()

    async def _read_registry(self) -> None:
        timeout = self._config.state_timeout
        try:
            adapters, token = [], ""
            while True:
                page = await self._admin.ListAdapters(admin_pb.ListAdaptersRequest(page_size=_PAGE_SIZE,
                                                                                    page_token=token),
                                                      metadata=self._metadata, timeout=timeout)
                adapters.extend(page.adapters)
                token = page.next_page_token
                if not token:
                    break
            pods = await self._admin.ListPods(admin_pb.ListPodsRequest(), metadata=self._metadata, timeout=timeout)
        except grpc.aio.AioRpcError as e:
            self._metrics.state_read_failures.labels("control_plane").inc()
            if not self._cp_failing:
                log.warning("cannot read the control plane; routing on the last registry read",
                            extra={"control_plane": self._config.control_plane, "code": e.code().name,
                                   "error": e.details()})
            self._cp_failing = True
            return
        if self._cp_failing:
            log.info("control plane readable again", extra={"control_plane": self._config.control_plane})
        self._cp_failing = False
        self._registry = (adapters, list(pods.pods))

    async def _read_pod(self, pod: admin_pb.Pod) -> pod_pb.PodState | None:
        """The pod's state, or None when it is unreachable or its Generation service is not SERVING
        (starting or draining)."""
        channel = self._channels.get(pod.endpoint)
        timeout = self._config.state_timeout
        health, state = await asyncio.gather(
            health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service=_GENERATION),
                                                      timeout=timeout),
            data_plane_admin_pb2_grpc.DataPlaneAdminStub(channel).GetState(
                pod_pb.GetStateRequest(), metadata=self._metadata, timeout=timeout),
            return_exceptions=True)
        for answer in (health, state):
            if isinstance(answer, BaseException):
                self._metrics.state_read_failures.labels("pod").inc()
                code = answer.code().name if isinstance(answer, grpc.aio.AioRpcError) else type(answer).__name__
                log.debug("cannot read a pod's state", extra={"pod": pod.id, "code": code})
                return None
        return state if health.status == health_pb2.HealthCheckResponse.SERVING else None

    async def close(self) -> None:
        await self._cp_channel.close()
