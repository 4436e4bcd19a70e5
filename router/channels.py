"""One gRPC channel per pod endpoint, shared by state reads and forwarded requests."""

from __future__ import annotations

import asyncio

import grpc

from conventions.tls import PLAINTEXT, Dialer

# How long a channel to a pod that left the fleet stays open for the streams still running on it.
_CLOSE_GRACE_S = 60.0


class PodChannels:
    """Opens a channel on first use of an endpoint, dialed as ``dialer`` says, and keeps it until the
    endpoint leaves the fleet."""

    def __init__(self, dialer: Dialer = PLAINTEXT) -> None:
        self._dialer = dialer
        self._channels: dict[str, grpc.aio.Channel] = {}
        self._closing: set[asyncio.Task] = set()

    def get(self, endpoint: str) -> grpc.aio.Channel:
        channel = self._channels.get(endpoint)
        if channel is None:
            channel = self._channels[endpoint] = self._dialer.aio_channel(endpoint)
        return channel

    def keep_only(self, endpoints: set[str]) -> None:
        """Closes, in the background and after their streams end (at most a minute), the channels of
        endpoints not in ``endpoints``: pods that left the fleet."""
        for endpoint in set(self._channels) - endpoints:
            task = asyncio.get_running_loop().create_task(self._channels.pop(endpoint).close(_CLOSE_GRACE_S))
            self._closing.add(task)
            task.add_done_callback(self._closing.discard)

    async def close(self) -> None:
        """Closes every channel at once, cancelling what still runs on them."""
        channels, self._channels = list(self._channels.values()), {}
        for task in list(self._closing):
            task.cancel()
        for channel in channels:
            await channel.close()
