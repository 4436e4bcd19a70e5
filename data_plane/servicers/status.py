"""The one place where the pod's domain errors become gRPC status codes."""

from __future__ import annotations

import logging

import grpc

from data_plane import errors

log = logging.getLogger("lorafleet.rpc")

STATUS = {
    errors.InvalidRequest: grpc.StatusCode.INVALID_ARGUMENT,
    errors.InvalidAdapter: grpc.StatusCode.INVALID_ARGUMENT,
    errors.AdapterNotFound: grpc.StatusCode.NOT_FOUND,
    errors.CapacityExceeded: grpc.StatusCode.RESOURCE_EXHAUSTED,
    errors.QueueFull: grpc.StatusCode.RESOURCE_EXHAUSTED,
    errors.AdapterBusy: grpc.StatusCode.FAILED_PRECONDITION,
    errors.ShuttingDown: grpc.StatusCode.UNAVAILABLE,
    errors.NotReady: grpc.StatusCode.UNAVAILABLE,
    errors.ControlPlaneUnavailable: grpc.StatusCode.UNAVAILABLE,
    errors.StaleCommand: grpc.StatusCode.ABORTED,
}


def status_of(error: errors.LorafleetError) -> grpc.StatusCode:
    for cls in type(error).__mro__:
        if cls in STATUS:
            return STATUS[cls]
    return grpc.StatusCode.INTERNAL


async def _abort(context, method: str, error: Exception):
    if isinstance(error, errors.LorafleetError):
        code = status_of(error)
        log.info("rpc failed", extra={"method": method, "code": code.name, "error": str(error)})
        await context.abort(code, str(error))
    log.exception("rpc crashed", extra={"method": method}, exc_info=error)
    await context.abort(grpc.StatusCode.INTERNAL, f"internal error in {method}: {type(error).__name__}; see pod logs")


class ErrorStatusInterceptor(grpc.aio.ServerInterceptor):
    """Aborts a call whose handler raised with the matching status and the error's message;
    an unexpected exception is INTERNAL and logged with its traceback."""

    async def intercept_service(self, continuation, handler_call_details):
        handler = await continuation(handler_call_details)
        method = handler_call_details.method
        if handler is None:
            return handler
        if handler.unary_unary is not None:
            inner = handler.unary_unary

            async def unary(request, context):
                try:
                    return await inner(request, context)
                except grpc.aio.AbortError:
                    raise
                except Exception as e:
                    await _abort(context, method, e)

            return grpc.unary_unary_rpc_method_handler(unary, handler.request_deserializer,
                                                       handler.response_serializer)
        if handler.unary_stream is not None:
            inner_stream = handler.unary_stream

            async def stream(request, context):
                try:
                    async for item in inner_stream(request, context):
                        yield item
                except grpc.aio.AbortError:
                    raise
                except Exception as e:
                    await _abort(context, method, e)

            return grpc.unary_stream_rpc_method_handler(stream, handler.request_deserializer,
                                                        handler.response_serializer)
        return handler
