"""Thin gRPC servicers of the pod: proto <-> domain, one call each."""

from __future__ import annotations

from data_plane.engine.engine import Engine
from data_plane.errors import NotReady


class EngineHandle:
    """The servicers' way to the engine, which exists only once the model has loaded: the gRPC
    server (and its health service) starts first, and calls before then get UNAVAILABLE."""

    def __init__(self) -> None:
        self.engine: Engine | None = None

    def get(self) -> Engine:
        if self.engine is None:
            raise NotReady("the pod is still loading its model; retry in a few seconds")
        return self.engine
