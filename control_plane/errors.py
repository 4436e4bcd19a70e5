"""Typed domain errors of the control plane.

Each message tells the caller what to fix, and each class names its gRPC status (see
``conventions.errors``); nothing below the servicers knows about gRPC.
"""

from __future__ import annotations

from conventions.errors import ConfigError, LorafleetError

__all__ = ["AdapterExists", "AdapterNotFound", "BaseModelMismatch", "ConfigError", "ControlPlaneError",
           "InvalidArgument", "NotLeader", "StoreUnavailable", "Unauthenticated", "VersionConflict"]


class ControlPlaneError(LorafleetError):
    """Base class of every error the control plane reports to a caller."""


class InvalidArgument(ControlPlaneError):
    """A request field is malformed or out of range."""

    status = "INVALID_ARGUMENT"


class AdapterNotFound(ControlPlaneError):
    """No adapter of that name is registered."""

    status = "NOT_FOUND"


class AdapterExists(ControlPlaneError):
    """The name is already registered to a different adapter."""

    status = "ALREADY_EXISTS"


class VersionConflict(ControlPlaneError):
    """A compare-and-set found a newer record version than the caller expected."""

    status = "ABORTED"


class BaseModelMismatch(ControlPlaneError):
    """A pod serves a different base model than the fleet's."""

    status = "FAILED_PRECONDITION"


class Unauthenticated(ControlPlaneError):
    """The call carried no bearer token or a wrong one."""

    status = "UNAUTHENTICATED"


class StoreUnavailable(ControlPlaneError):
    """Redis cannot be reached or failed to answer."""

    status = "UNAVAILABLE"


class NotLeader(ControlPlaneError):
    """Redis refused a reconciler write: the writer's fencing token is no longer the lease's."""

    status = "ABORTED"
