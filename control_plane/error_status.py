"""The one place where domain errors become gRPC status codes (and RPCs are counted)."""

from __future__ import annotations

import logging
import time

import grpc

from control_plane import errors
from control_plane.metrics import ControlPlaneMetrics

log = logging.getLogger(__name__)

STATUS = {
    errors.InvalidArgument: grpc.StatusCode.INVALID_ARGUMENT,
    errors.AdapterNotFound: grpc.StatusCode.NOT_FOUND,
    errors.AdapterExists: grpc.StatusCode.ALREADY_EXISTS,
    errors.VersionConflict: grpc.StatusCode.ABORTED,
    errors.BaseModelMismatch: grpc.StatusCode.FAILED_PRECONDITION,
    errors.Unauthenticated: grpc.StatusCode.UNAUTHENTICATED,
    errors.StoreUnavailable: grpc.StatusCode.UNAVAILABLE,
    errors.ConfigError: grpc.StatusCode.INTERNAL,
}


def status_of(error: errors.ControlPlaneError) -> grpc.StatusCode:
    for cls in type(error).__mro__:
        if cls in STATUS:
            return STATUS[cls]
    return grpc.StatusCode.INTERNAL


class ErrorStatusInterceptor(grpc.aio.ServerInterceptor):
    """Aborts a unary call that raised a domain error with the matching status and the error's
    message; anything else is INTERNAL and logged. Counts every unary call by method and code."""

    def __init__(self, metrics: ControlPlaneMetrics) -> None:
        self._metrics = metrics

    async def intercept_service(self, continuation, handler_call_details):
        handler = await continuation(handler_call_details)
        if handler is None or handler.unary_unary is None:
            return handler
        method, inner = handler_call_details.method, handler.unary_unary

        async def unary(request, context):
            start, code = time.perf_counter(), grpc.StatusCode.OK
            try:
                return await inner(request, context)
            except errors.ControlPlaneError as e:
                code = status_of(e)
                log.info("rpc failed", extra={"method": method, "code": code.name, "error": str(e)})
                await context.abort(code, str(e))
            except Exception as e:
                if isinstance(e, grpc.aio.AbortError):
                    code = context.code() or grpc.StatusCode.UNKNOWN
                    raise
                code = grpc.StatusCode.INTERNAL
                log.exception("rpc crashed", extra={"method": method})
                await context.abort(code, f"internal error in {method}: {type(e).__name__}; see server logs")
            finally:
                self._metrics.rpcs.labels(method, code.name).inc()
                self._metrics.rpc_seconds.labels(method).observe(time.perf_counter() - start)

        return grpc.unary_unary_rpc_method_handler(
            unary, request_deserializer=handler.request_deserializer,
            response_serializer=handler.response_serializer)
