"""The one place where domain errors become gRPC status codes, for every lorafleet server."""

from __future__ import annotations

import asyncio
import inspect
import logging
import time
from collections.abc import Callable

import grpc

from conventions.errors import LorafleetError

log = logging.getLogger("lorafleet.rpc")

# Called once per finished call with (method, status code name, seconds).
CallObserver = Callable[[str, str, float], None]


# The trailing-metadata key of gRPC's retry throttling: how many milliseconds a client should wait
# before it sends the call again (gRFC A6); a refusal under load carries it.
RETRY_PUSHBACK_KEY = "grpc-retry-pushback-ms"


def retry_pushback(error: BaseException) -> tuple[tuple[str, str], ...]:
    """The trailing metadata that carries ``error``'s retry hint, if it has one."""
    after = getattr(error, "retry_after_s", None)
    if after is None:
        return ()
    return ((RETRY_PUSHBACK_KEY, str(max(0, round(after * 1000)))),)


def retry_after_s(metadata) -> float | None:
    """The retry hint (seconds) in a call's trailing metadata, or None when it carries none."""
    for key, value in metadata or ():
        if key == RETRY_PUSHBACK_KEY:
            try:
                return max(0, int(value)) / 1000
            except ValueError:
                return None
    return None


class CallOutcome:
    """The status name a ``with`` block of a call ends with, for metrics and logs: ``OK`` when it completes,
    a domain error's own status, ``CANCELLED`` when the caller went away (a generator closed early, a
    task cancelled), ``INTERNAL`` for anything else. Read ``name`` after the block."""

    def __init__(self) -> None:
        self.name = "CANCELLED"

    def __enter__(self) -> CallOutcome:
        return self

    def __exit__(self, kind, error, traceback) -> bool:
        if kind is None:
            self.name = "OK"
        elif isinstance(error, LorafleetError):
            self.name = error.status
        elif not isinstance(error, (GeneratorExit, asyncio.CancelledError)):
            self.name = "INTERNAL"
        return False


def status_of(error: BaseException) -> grpc.StatusCode:
    """The status a call that raised ``error`` ends with: the error's own for a domain error,
    INTERNAL for anything else."""
    if isinstance(error, LorafleetError):
        return grpc.StatusCode[error.status]
    return grpc.StatusCode.INTERNAL


async def _abort(context, method: str, error: Exception) -> None:
    code = status_of(error)
    if isinstance(error, LorafleetError):
        log.info("rpc failed", extra={"method": method, "code": code.name, "error": str(error)})
        await context.abort(code, str(error), trailing_metadata=retry_pushback(error))
    log.exception("rpc crashed", extra={"method": method}, exc_info=error)
    await context.abort(code, f"internal error in {method}: {type(error).__name__}; see the server's logs")


class ErrorStatusInterceptor(grpc.aio.ServerInterceptor):
    """Ends a call whose handler raised a ``LorafleetError`` with that error's status and message;
    anything unexpected is INTERNAL and logged with its traceback. Unary and server-streaming
    calls alike. ``observe``, if given, sees every call's method, final code and duration."""

    def __init__(self, observe: CallObserver | None = None) -> None:
        self._observe = observe

    async def intercept_service(self, continuation, handler_call_details):
        handler = await continuation(handler_call_details)
        if handler is None:
            return handler
        method = handler_call_details.method
        if handler.unary_unary is not None:
            return grpc.unary_unary_rpc_method_handler(self._awaited(method, handler.unary_unary),
                                                       handler.request_deserializer, handler.response_serializer)
        if handler.unary_stream is not None:
            inner = handler.unary_stream
            # A streaming handler is an async generator, or a coroutine that writes with context.write()
            # (grpc's own Health.Watch): the one is iterated, the other awaited.
            wrapped = self._iterated(method, inner) if inspect.isasyncgenfunction(inner) \
                else self._awaited(method, inner)
            return grpc.unary_stream_rpc_method_handler(wrapped, handler.request_deserializer,
                                                        handler.response_serializer)
        return handler

    def _awaited(self, method: str, inner):
        async def call(request, context):
            with _Outcome(method, context, self._observe) as outcome:
                try:
                    return await inner(request, context)
                except grpc.aio.AbortError:
                    raise
                except Exception as e:
                    outcome.code = status_of(e)
                    await _abort(context, method, e)

        return call

    def _iterated(self, method: str, inner):
        async def stream(request, context):
            with _Outcome(method, context, self._observe) as outcome:
                try:
                    async for item in inner(request, context):
                        yield item
                except grpc.aio.AbortError:
                    raise
                except Exception as e:
                    outcome.code = status_of(e)
                    await _abort(context, method, e)

        return stream


class _Outcome:
    """Times one call and reports its final code: the raised error's, or the code a handler
    aborted with itself, else OK."""

    def __init__(self, method: str, context, observe: CallObserver | None) -> None:
        self._method, self._context, self._observe = method, context, observe
        self.code: grpc.StatusCode | None = None

    def __enter__(self) -> _Outcome:
        self._start = time.perf_counter()
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if self._observe is None:
            return
        code = self.code
        if code is None:
            if exc_type is None:
                code = grpc.StatusCode.OK
            elif issubclass(exc_type, grpc.aio.AbortError):
                code = self._context.code() or grpc.StatusCode.UNKNOWN
            else:  # cancelled, or a stream the client stopped reading
                code = grpc.StatusCode.CANCELLED
        self._observe(self._method, code.name, time.perf_counter() - self._start)
