"""Typed domain errors of the data plane.

Each error carries a message that tells the user what to fix. One gRPC interceptor maps
these to status codes (see ``grpc_status``); nothing below the servicers knows about gRPC.
"""

from __future__ import annotations


class LorafleetError(Exception):
    """Base class of every error the data plane reports to a caller."""


class ModelLoadError(LorafleetError):
    """The model directory is missing files, names an unsupported architecture, or its
    weights do not fit its config."""


class InvalidRequest(LorafleetError):
    """A request parameter is out of range or malformed."""


class AdapterNotFound(LorafleetError):
    """No adapter of that name is known to the pod."""


class InvalidAdapter(LorafleetError):
    """An adapter's files or weights cannot be served on this model."""


class CapacityExceeded(LorafleetError):
    """Honouring the call would evict a pinned adapter or exceed a configured limit."""


class AdapterBusy(LorafleetError):
    """The adapter is in use by running requests and cannot be unloaded now."""


class QueueFull(LorafleetError):
    """The pod's request queue is full; retry later or on another pod."""


class ShuttingDown(LorafleetError):
    """The pod is draining and accepts no new requests."""


class StaleCommand(LorafleetError):
    """A command carried a fencing token older than one the pod has already seen."""


class ControlPlaneUnavailable(LorafleetError):
    """The control plane could not be reached or refused the pod's credentials."""


class NotReady(LorafleetError):
    """The pod is still loading its model; retry shortly."""


class StepFailed(LorafleetError):
    """A forward pass failed; the requests in that step end, the pod keeps serving."""
