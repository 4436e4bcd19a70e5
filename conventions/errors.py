"""The root of every typed domain error a lorafleet process reports to a caller.

Each error class names the gRPC status it becomes in ``status`` (a ``grpc.StatusCode`` name), so
the domain below the servicers never imports gRPC; ``conventions.status`` turns it into the
status of the call. Messages say what the caller should fix.
"""

from __future__ import annotations


class LorafleetError(Exception):
    """Base class of every error reported to a caller; an unexpected one is INTERNAL.

    ``retry_after_s``, when given, tells the caller how long to wait before sending the same request
    here again (a refusal under load); the gRPC status carries it as ``grpc-retry-pushback-ms``."""

    status = "INTERNAL"

    def __init__(self, message: str = "", *, retry_after_s: float | None = None) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s


class ConfigError(LorafleetError):
    """A flag, file or configuration value is invalid."""
