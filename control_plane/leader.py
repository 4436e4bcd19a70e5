"""The reconciler leader lease: at most one replica drives pods, and its commands are fenced.

The lease is a Redis key with a TTL. Taking a lapsed lease issues a new fencing token, larger
than every earlier one; the leader sends it with every DataPlaneAdmin command, and pods refuse
tokens older than the newest they have seen, so a deposed leader (paused, partitioned, slow)
cannot undo its successor's work.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time

from control_plane.errors import StoreUnavailable
from control_plane.metrics import ControlPlaneMetrics
from control_plane.store import Store

log = logging.getLogger(__name__)


class LeaderLease:
    """Contends for, holds and renews the lease; ``token`` is non-zero only while it is safe
    to act as leader."""

    def __init__(self, store: Store, replica: str, ttl_s: float, metrics: ControlPlaneMetrics,
                 clock=time.monotonic) -> None:
        self._store = store
        self.replica = replica
        self._ttl_s = ttl_s
        self._metrics = metrics
        self._clock = clock
        self._token = 0
        # The lease is counted from before the request was sent, so this replica stops acting
        # no later than Redis expires its key, whatever the round-trip took.
        self._valid_until = 0.0

    @property
    def token(self) -> int:
        """The fencing token while this replica holds an unexpired lease, else 0."""
        return self._token if self._clock() < self._valid_until else 0

    async def renew(self) -> int:
        """Takes or renews the lease once; returns the token (0 when another replica leads)."""
        started = self._clock()
        try:
            token = await self._store.acquire_leadership(self.replica, self._ttl_s)
        except StoreUnavailable as e:
            log.warning("leader lease not renewed", extra={"replica": self.replica, "error": str(e)})
            token = 0
        self._set(token, started + self._ttl_s if token else 0.0)
        return token

    def step_down(self, reason: str) -> None:
        """Stops acting as leader at once (the lease key lapses on its own)."""
        if self._token:
            log.warning("stepping down as leader", extra={"replica": self.replica, "reason": reason})
        self._set(0, 0.0)

    async def run(self, stop: asyncio.Event) -> None:
        """Renews the lease three times per TTL until ``stop`` is set, then releases it."""
        try:
            while not stop.is_set():
                await self.renew()
                with contextlib.suppress(asyncio.TimeoutError):
                    await asyncio.wait_for(stop.wait(), self._ttl_s / 3)
        finally:
            await self.release()

    async def release(self) -> None:
        token, self._token = self._token, 0
        if token:
            try:
                await self._store.release_leadership(self.replica, token)
                log.info("leader lease released", extra={"replica": self.replica, "fencing_token": token})
            except StoreUnavailable:
                pass  # it lapses on its own within the TTL
        self._set(0, 0.0)

    def _set(self, token: int, valid_until: float) -> None:
        if token != self._token:
            if token:
                log.info("leader lease acquired", extra={"replica": self.replica, "fencing_token": token})
            elif self._token:
                log.warning("leader lease lost", extra={"replica": self.replica, "fencing_token": self._token})
        self._token, self._valid_until = token, valid_until
        self._metrics.leader.set(1 if token else 0)
        self._metrics.fencing_token.set(token)
