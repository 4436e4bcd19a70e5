"""Typed domain errors of the control plane.

Each message tells the caller what to fix. ``error_status.ErrorStatusInterceptor`` maps
them to gRPC status codes; nothing below the servicers knows about gRPC.
"""

from __future__ import annotations


class ControlPlaneError(Exception):
    """Base class of every error the control plane reports to a caller."""


class ConfigError(ControlPlaneError):
    """A flag or configuration value is invalid."""


class InvalidArgument(ControlPlaneError):
    """A request field is malformed or out of range."""


class AdapterNotFound(ControlPlaneError):
    """No adapter of that name is registered."""


class AdapterExists(ControlPlaneError):
    """The name is already registered to a different adapter."""


class VersionConflict(ControlPlaneError):
    """A compare-and-set found a newer record version than the caller expected."""


class BaseModelMismatch(ControlPlaneError):
    """A pod serves a different base model than the fleet's."""


class Unauthenticated(ControlPlaneError):
    """The call carried no bearer token or a wrong one."""


class StoreUnavailable(ControlPlaneError):
    """Redis cannot be reached or failed to answer."""
