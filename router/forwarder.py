"""``lorafleet.v1.Generation/Generate``, forwarded: a request (parsed once at its door, router/request.py)
goes as its bytes to the best pod, and each response message's bytes come back as the pod sent them. Both
doors (router/door.py: gRPC, and the OpenAI HTTP API through it) forward through ``Forwarder.stream``."""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import AsyncIterator

import grpc
from lorafleet.v1 import generation_pb2

from conventions.errors import LorafleetError
from conventions.status import CallOutcome, retry_after_s
from router.channels import PodChannels
from router.metrics import RouterMetrics
from router.picker import PodPicker
from router.request import RoutedRequest
from router.scoring import Choice

log = logging.getLogger("lorafleet.router")

SERVICE = generation_pb2.DESCRIPTOR.services_by_name["Generation"].full_name
GENERATE = f"/{SERVICE}/Generate"
# Refusals that leave the request untouched, so another pod may take it.
RETRYABLE = (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.RESOURCE_EXHAUSTED)


class PodError(LorafleetError):
    """A pod ended the call with an error; the caller gets the pod's status, its retry hint, and its message
    (or ``message``, which says more)."""

    def __init__(self, error: grpc.aio.AioRpcError, message: str | None = None) -> None:
        super().__init__(error.details() or "" if message is None else message,
                         retry_after_s=retry_after_s(error.trailing_metadata()))
        self.status = error.code().name


def same_precision(ranked: list[Choice]) -> list[Choice]:
    """``ranked`` without the pods whose precision differs from the first one's, in order."""
    return [c for c in ranked if c.pod.precision == ranked[0].pod.precision] if ranked else ranked



class Forwarder:
    """Serves Generate by forwarding it. Before a pod's first message, a refusal that leaves the request
    untouched (UNAVAILABLE, RESOURCE_EXHAUSTED) sends it to the next pod of the first pod's precision, up
    to ``retries`` more (a pod of another precision would give other tokens than the pod chosen). When
    every pod tried refuses, the caller gets RESOURCE_EXHAUSTED with the shortest retry hint
    (grpc-retry-pushback-ms) if any pod said it is full (``every_pod_refused``). After the first message
    the pod's error is the caller's, with the pod's retry hint when it sent one. A pod that answered
    RESOURCE_EXHAUSTED goes last in the ranking for as long as its hint says. The caller's deadline goes
    to the pod with the call, and a caller that goes away cancels the pod's call, which frees the request
    there."""

    def __init__(self, picker: PodPicker, channels: PodChannels, metrics: RouterMetrics, retries: int) -> None:
        self._picker, self._channels, self._metrics, self._retries = picker, channels, metrics, retries

    async def stream(self, request: RoutedRequest, timeout: float | None) -> AsyncIterator[bytes]:
        """The serialized GenerateResponse messages of ``request`` from the best pod that takes it, within
        ``timeout`` seconds (None: no deadline). Raises AdapterNotRegistered, NoPodAvailable or PodError.
        Closing the generator early cancels the pod's call, which frees the request there. Both doors call
        this."""
        arrived = time.perf_counter()
        adapter_class = "adapter" if request.adapter else "base"
        outcome = CallOutcome()
        try:
            with outcome:
                # aclosing: when our caller stops early, the pod's call is cancelled now, not at garbage collection
                async with contextlib.aclosing(self._forward(request, adapter_class, timeout, arrived)) as messages:
                    async for message in messages:
                        yield message
        finally:
            self._metrics.requests.labels(adapter_class, outcome.name).inc()

    async def _forward(self, request: RoutedRequest, adapter_class: str, timeout: float | None,
                       arrived: float) -> AsyncIterator[bytes]:
        adapter = request.adapter
        hashes = request.prefix_chain() if self._picker.weighs_prefixes else ()
        candidates = same_precision(self._picker.choose(adapter, hashes))[: self._retries + 1]
        refusals: list[grpc.aio.AioRpcError] = []
        for attempt, choice in enumerate(candidates):
            pod = choice.pod
            call = self._channels.get(pod.endpoint).unary_stream(GENERATE)(request.payload, timeout=timeout)
            self._picker.started(pod.id, adapter)
            self._metrics.decisions.labels(choice.decision.label).inc()
            if hashes:
                held = "all" if choice.matched == len(hashes) else "part" if choice.matched else "none"
                self._metrics.prefix_decisions.labels(held).inc()
            try:
                try:
                    message = await call.read()
                except grpc.aio.AioRpcError as e:
                    if e.code() not in RETRYABLE:
                        raise PodError(e) from None
                    self._refused(pod.id, e)
                    refusals.append(e)
                    if attempt + 1 < len(candidates):
                        self._metrics.retries.labels(e.code().name).inc()
                        continue
                    raise every_pod_refused(refusals) from None
                self._metrics.ttft.labels(adapter_class).observe(time.perf_counter() - arrived)
                while message is not grpc.aio.EOF:
                    yield message
                    message = await call.read()
                return
            except grpc.aio.AioRpcError as e:  # after the first message: the pod's error is the caller's
                raise PodError(e) from None
            finally:
                call.cancel()  # a no-op once the call ended; otherwise the caller went away
                self._picker.finished(pod.id)

    def _refused(self, pod: str, error: grpc.aio.AioRpcError) -> None:
        if error.code() == grpc.StatusCode.UNAVAILABLE:
            self._picker.refused(pod)
        else:  # RESOURCE_EXHAUSTED: full; its retry hint says for how long
            self._picker.pushed_back(pod, retry_after_s(error.trailing_metadata()))
        log.info("pod refused a request", extra={"pod": pod, "code": error.code().name, "error": error.details()})


def every_pod_refused(refusals: list[grpc.aio.AioRpcError]) -> PodError:
    """What the caller gets when every pod tried refused before its first message: when any said it is
    full, RESOURCE_EXHAUSTED with the shortest retry hint among them (the soonest any pod expects room)
    and that pod's message; else the last refusal."""
    full = [e for e in refusals if e.code() == grpc.StatusCode.RESOURCE_EXHAUSTED]
    if not full:
        return PodError(refusals[-1])
    hinted = [(hint, e) for e in full if (hint := retry_after_s(e.trailing_metadata())) is not None]
    soonest = min(hinted, key=lambda pair: pair[0])[1] if hinted else full[-1]
    if len(refusals) == 1:
        return PodError(soonest)
    return PodError(soonest, f"every pod tried ({len(refusals)}) refused the request, {len(full)} as full; the "
                             f"soonest to have room says: {soonest.details()}")
