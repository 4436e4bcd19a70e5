"""Errors of the OpenAI-compatible HTTP API, in OpenAI's shape: an HTTP status and
``{"error": {"message", "type", "param", "code"}}``. Router and pod errors map onto them by gRPC status."""

from __future__ import annotations

import math

from conventions.errors import LorafleetError

# gRPC status name of a router or pod error -> (HTTP status, OpenAI error type).
_BY_STATUS = {
    "INVALID_ARGUMENT": (400, "invalid_request_error"),
    "OUT_OF_RANGE": (400, "invalid_request_error"),
    "UNAUTHENTICATED": (401, "authentication_error"),
    "PERMISSION_DENIED": (403, "permission_error"),
    "NOT_FOUND": (404, "not_found_error"),
    "RESOURCE_EXHAUSTED": (429, "rate_limit_error"),
    "UNAVAILABLE": (503, "service_unavailable_error"),
    "DEADLINE_EXCEEDED": (504, "timeout_error"),
}
_SERVER_ERROR = (500, "server_error")


class ApiError(LorafleetError):
    """A refused HTTP API request: ``http_status`` and the body OpenAI clients read."""

    def __init__(self, http_status: int, message: str, type_: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.http_status, self.type, self.param, self.code = http_status, type_, param, code

    def body(self) -> dict:
        return {"error": {"message": str(self), "type": self.type, "param": self.param, "code": self.code}}


def invalid(param: str | None, message: str) -> ApiError:
    """400 for a bad request field ``param`` (None: the body as a whole)."""
    return ApiError(400, message, param=param)


def from_domain(error: LorafleetError) -> ApiError:
    """The HTTP form of a router or pod error, by its gRPC status; its message and retry hint are kept."""
    if isinstance(error, ApiError):
        return error
    http_status, type_ = _BY_STATUS.get(error.status, _SERVER_ERROR)
    api = ApiError(http_status, str(error) or error.status, type_, code=error.status.lower())
    api.retry_after_s = error.retry_after_s
    return api


def retry_after_header(error: ApiError) -> dict[str, str]:
    """The Retry-After header (whole seconds, rounded up) of a refusal that carries a retry hint."""
    if error.retry_after_s is None:
        return {}
    return {"Retry-After": str(max(1, math.ceil(error.retry_after_s)))}
