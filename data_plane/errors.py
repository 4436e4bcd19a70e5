"""Typed domain errors of the data plane.

Each error carries a message that tells the user what to fix, and each class names its gRPC
status (see ``conventions.errors``); nothing below the servicers knows about gRPC.
"""

from __future__ import annotations

from conventions.errors import LorafleetError

__all__ = ["AdapterBusy", "AdapterNotFound", "CapacityExceeded", "ControlPlaneUnavailable", "DeadlineExceeded",
           "DigestMismatch", "InvalidAdapter", "InvalidRequest", "LoraDisabled", "LorafleetError", "ModelLoadError",
           "NotReady", "Overloaded", "QueueFull", "ShuttingDown", "SourceDenied", "SourceUnavailable", "StaleCommand",
           "StepFailed"]


class ModelLoadError(LorafleetError):
    """The model directory is missing files, names an unsupported architecture, or its
    weights do not fit its config."""


class InvalidRequest(LorafleetError):
    """A request parameter is out of range or malformed."""

    status = "INVALID_ARGUMENT"


class AdapterNotFound(LorafleetError):
    """No adapter of that name is known to the pod."""

    status = "NOT_FOUND"


class LoraDisabled(LorafleetError):
    """The pod was started without LoRA (--no-enable-lora): it serves the base model only."""

    status = "FAILED_PRECONDITION"


class InvalidAdapter(LorafleetError):
    """An adapter's files or weights cannot be served on this model."""

    status = "INVALID_ARGUMENT"


class SourceDenied(LorafleetError):
    """The pod may not fetch from an adapter's source: its --adapter-source-allow refuses it, or the
    storage refused the pod's credentials."""

    status = "PERMISSION_DENIED"


class SourceUnavailable(LorafleetError):
    """The adapter's storage could not be reached or failed to answer; retrying later may succeed."""

    status = "UNAVAILABLE"


class DigestMismatch(LorafleetError):
    """The downloaded weights are not the registered ones (another sha256): the source changed or is
    corrupt; nothing was installed."""

    status = "FAILED_PRECONDITION"


class CapacityExceeded(LorafleetError):
    """Honouring the call would evict a pinned adapter or exceed a configured limit."""

    status = "RESOURCE_EXHAUSTED"


class AdapterBusy(LorafleetError):
    """The adapter is in use by running requests and cannot be unloaded now."""

    status = "FAILED_PRECONDITION"


class QueueFull(LorafleetError):
    """The pod's request queue is full; retry later or on another pod."""

    status = "RESOURCE_EXHAUSTED"


class Overloaded(LorafleetError):
    """The pod would start the request only after its deadline or --max-queue-delay; the error's
    ``retry_after_s`` says when this pod expects to have room."""

    status = "RESOURCE_EXHAUSTED"


class DeadlineExceeded(LorafleetError):
    """The request's deadline passed while it waited in the queue."""

    status = "DEADLINE_EXCEEDED"


class ShuttingDown(LorafleetError):
    """The pod is draining and accepts no new requests."""

    status = "UNAVAILABLE"


class StaleCommand(LorafleetError):
    """A command carried a fencing token older than one the pod has already seen."""

    status = "ABORTED"


class ControlPlaneUnavailable(LorafleetError):
    """The control plane could not be reached or refused the pod's credentials."""

    status = "UNAVAILABLE"


class NotReady(LorafleetError):
    """The pod is still loading its model; retry shortly."""

    status = "UNAVAILABLE"


class StepFailed(LorafleetError):
    """A forward pass failed; the requests in that step end, the pod keeps serving."""
