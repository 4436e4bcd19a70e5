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


class Unauthenticated(LorafleetError):
    """No key, or a key no tenant holds."""

    status = "UNAUTHENTICATED"


class PermissionDenied(LorafleetError):
    """The key's tenant may not use the adapter it names (whether that adapter exists is not said)."""

    status = "PERMISSION_DENIED"


class RateLimited(LorafleetError):
    """The key's tenant is over one of its limits; ``retry_after_s`` says when it is not."""

    status = "RESOURCE_EXHAUSTED"
