"""Typed errors the router reports to its callers; each names its gRPC status (see conventions.errors)."""

from __future__ import annotations

from conventions.errors import LorafleetError


class InvalidRequest(LorafleetError):
    """The request bytes are not a GenerateRequest."""

    status = "INVALID_ARGUMENT"


class AdapterNotRegistered(LorafleetError):
    """The request names an adapter the control plane does not know."""

    status = "NOT_FOUND"


class NoPodAvailable(LorafleetError):
    """No ready pod can take the request now (none known yet, all draining, or all refused it)."""

    status = "UNAVAILABLE"
