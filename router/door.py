"""The router's gRPC ``Generate`` behind the tenants' gate, and the usage record of every request through
either door: each call is checked (key, adapter, limits) before it is forwarded with its tenant named in
``GenerateRequest.tenant`` (the pods' fair shares weigh tenants), and when it ends its
tokens are counted per tenant and adapter, charged to the tenant's tokens per minute, and logged as one
``usage`` record (tenant, adapter, door, tokens, TTFT, outcome)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator

import grpc
from lorafleet.v1 import generation_pb2

from conventions.status import CallOutcome
from router.access import Access
from router.errors import InvalidRequest
from router.forwarder import SERVICE, Forwarder
from router.metrics import RouterMetrics
from router.request import RoutedRequest
from router.tenants import Tenant

log = logging.getLogger("lorafleet.router.usage")


class Door:
    """Serves gRPC Generate through ``access``; ``stream`` is the same path for the HTTP API."""

    def __init__(self, forwarder: Forwarder, access: Access, metrics: RouterMetrics) -> None:
        self._forwarder, self._access, self._metrics = forwarder, access, metrics
        self._charging: set[asyncio.Task] = set()

    def handler(self) -> grpc.GenericRpcHandler:
        """The generic handler to add to a server: raw bytes in and out, no (de)serializers."""
        return grpc.method_handlers_generic_handler(SERVICE, {"Generate": grpc.unary_stream_rpc_method_handler(
            self.generate)})

    async def generate(self, request: bytes, context: grpc.aio.ServicerContext) -> AsyncIterator[bytes]:
        tenant = None
        if self._access.grpc_guarded:
            tenant = self._access.tenant(dict(context.invocation_metadata() or ()).get("authorization"))
        try:
            routed = RoutedRequest.parse(request)
        except InvalidRequest:
            self._metrics.requests.labels("unknown", InvalidRequest.status).inc()
            raise
        async with contextlib.aclosing(self.stream(routed, tenant, context.time_remaining(), "grpc")) as messages:
            async for message in messages:
                yield message

    async def stream(self, request: RoutedRequest, tenant: Tenant | None, timeout: float | None,
                     door: str) -> AsyncIterator[bytes]:
        """Forwarder.stream for ``tenant`` (None: open doors) after the gate lets it in; records its usage
        however it ends. Raises PermissionDenied or RateLimited before anything is forwarded."""
        adapter = request.adapter
        arrived = time.perf_counter()
        ttft = None
        prompt_tokens = completion_tokens = 0
        outcome = CallOutcome()
        try:
            with outcome:
                await self._access.admit(tenant, adapter)
                if tenant is not None and self._access.grpc_guarded:
                    # the pod's fair share weighs the key's tenant; its cached prompts are the tenant's scope's alone
                    request = request.for_tenant(tenant.name, tenant.cache_scope)
                else:
                    request = request.for_open_door()
                async with contextlib.aclosing(self._forwarder.stream(request, timeout)) as messages:
                    async for raw in messages:
                        if ttft is None:
                            ttft = time.perf_counter() - arrived
                        message = generation_pb2.GenerateResponse.FromString(raw)
                        completion_tokens += len(message.tokens)
                        if message.HasField("usage"):
                            prompt_tokens = message.usage.prompt_tokens
                            completion_tokens = message.usage.completion_tokens
                        yield raw
        finally:
            self._record(tenant, adapter, door, outcome.name, prompt_tokens, completion_tokens, ttft,
                         time.perf_counter() - arrived)

    def _record(self, tenant: Tenant | None, adapter: str, door: str, outcome: str, prompt_tokens: int,
                completion_tokens: int, ttft: float | None, duration: float) -> None:
        labels = (tenant.name if tenant else "none", adapter or "base")
        self._metrics.tenant_requests.labels(*labels, outcome).inc()
        self._metrics.tenant_prompt_tokens.labels(*labels).inc(prompt_tokens)
        self._metrics.tenant_completion_tokens.labels(*labels).inc(completion_tokens)
        log.info("usage", extra={"tenant": labels[0], "adapter": labels[1], "door": door, "outcome": outcome,
                                 "prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
                                 "ttft_s": None if ttft is None else round(ttft, 4), "duration_s": round(duration, 4)})
        if tenant is not None and prompt_tokens + completion_tokens:
            # In the background: this runs in a finally that a cancelled caller may be unwinding.
            task = asyncio.get_running_loop().create_task(
                self._access.charge(tenant, prompt_tokens + completion_tokens))
            self._charging.add(task)
            task.add_done_callback(self._charging.discard)
