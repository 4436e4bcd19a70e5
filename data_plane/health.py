"""The pod's gRPC health: readiness, liveness, and the watchdog on the engine loop.

Readiness (service ``""`` and each served service) is SERVING once the model is loaded, until the
drain starts, and never while the engine loop is stalled. Liveness (``conventions.health.LIVENESS``)
is SERVING from start-up unless the engine loop is stalled, so a liveness probe restarts a wedged
pod, never one that is loading or draining. The loop is stalled when requests are running or
waiting and it has begun no iteration for ``stall_timeout_s`` (a hung forward pass, a lock never
released): a healthy loop begins one at least every step or every half second.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable

from grpc_health.v1 import health, health_pb2

from conventions.health import LIVENESS
from data_plane.engine.engine import Engine

log = logging.getLogger("lorafleet.data_plane")

SERVICES = ("lorafleet.v1.Generation", "lorafleet.v1.DataPlaneAdmin")
_SERVING, _NOT_SERVING = health_pb2.HealthCheckResponse.SERVING, health_pb2.HealthCheckResponse.NOT_SERVING


class PodHealth:
    """Owns the pod's HealthServicer (``servicer``) and every status it reports."""

    def __init__(self, stall_timeout_s: float, clock: Callable[[], float] = time.monotonic) -> None:
        self.servicer = health.aio.HealthServicer()
        self._stall_timeout_s = stall_timeout_s
        self._clock = clock
        self._ready = False
        self.stalled = False

    async def set_ready(self, ready: bool) -> None:
        """Readiness as far as start-up is concerned; a stall still overrides it."""
        self._ready = ready
        await self._publish()

    async def watch(self, engine: Engine) -> None:
        """Checks the engine loop every second (every quarter of the stall timeout, if that is shorter)
        until cancelled, flipping readiness and liveness when it stalls and again when it moves."""
        interval = min(1.0, self._stall_timeout_s / 4)
        while True:
            state = engine.snapshot()
            idle_s = self._clock() - engine.last_progress
            stalled = bool(state.running or state.waiting) and idle_s > self._stall_timeout_s
            if stalled != self.stalled:
                self.stalled = stalled
                if stalled:
                    log.error("engine loop stalled: health is NOT_SERVING",
                              extra={"seconds_without_progress": round(idle_s, 1), "running": state.running,
                                     "waiting": state.waiting})
                else:
                    log.warning("engine loop moving again: health follows readiness")
                await self._publish()
            await asyncio.sleep(interval)

    async def shutdown(self) -> None:
        """Every service NOT_SERVING for good: the pod drains."""
        await self.servicer.enter_graceful_shutdown()

    async def _publish(self) -> None:
        ready = _SERVING if self._ready and not self.stalled else _NOT_SERVING
        for name in ("", *SERVICES):
            await self.servicer.set(name, ready)
        await self.servicer.set(LIVENESS, _NOT_SERVING if self.stalled else _SERVING)
