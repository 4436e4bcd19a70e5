"""A Generate request as the router routes it, parsed once where it comes in.

The gRPC door receives a serialized ``GenerateRequest`` and parses it here; the HTTP door builds the message
itself. Everything routing reads (the adapter, the prefix chain the pod will compute, the tenant a guarded
door names) comes from that one parse, and the bytes forwarded to the pod are the caller's own, unchanged
but for the tenant appended (a field appended to a serialized message overrides an earlier value of it).
"""

from __future__ import annotations

from dataclasses import dataclass

from google.protobuf.message import DecodeError
from lorafleet.v1 import generation_pb2

from conventions.prefix_chain import chain, input_bytes
from router.errors import InvalidRequest


@dataclass(frozen=True)
class RoutedRequest:
    """A request on its way to a pod: the bytes it is forwarded as, and the message they hold."""

    payload: bytes  # the serialized GenerateRequest a pod receives
    message: generation_pb2.GenerateRequest  # what ``payload`` parses to

    @classmethod
    def parse(cls, payload: bytes) -> RoutedRequest:
        """The request ``payload`` holds; InvalidRequest if it is not a GenerateRequest."""
        try:
            return cls(payload, generation_pb2.GenerateRequest.FromString(payload))
        except DecodeError as e:
            raise InvalidRequest(f"the request is not a lorafleet.v1.GenerateRequest ({e}); "
                                 "send one built from protos/lorafleet/v1/generation.proto") from None

    @classmethod
    def of(cls, message: generation_pb2.GenerateRequest) -> RoutedRequest:
        """A request built in the router (the HTTP door), serialized once."""
        return cls(message.SerializeToString(), message)

    @property
    def adapter(self) -> str:
        """The adapter it names; "" = the base model."""
        return self.message.adapter

    def prefix_chain(self) -> tuple[int, ...]:
        """Its routing-prefix chain, as the pod that serves it computes it (conventions/prefix_chain.py)."""
        return chain(self.adapter, input_bytes(self.message), self.message.cache_salt)

    def for_tenant(self, tenant: str, cache_scope: str) -> RoutedRequest:
        """The same request with ``tenant`` named, whatever the caller wrote there (the pods' fair shares weigh
        the tenant a guarded door authenticated), and its cache salt under ``cache_scope`` (the tenant's, or
        its sharing group's), followed by the caller's own salt: no other scope's requests share its cached
        prompt blocks."""
        salt = f"{cache_scope}/{self.message.cache_salt}" if self.message.cache_salt else cache_scope
        change = generation_pb2.GenerateRequest(tenant=tenant, cache_salt=salt)
        message = generation_pb2.GenerateRequest()
        message.CopyFrom(self.message)
        message.MergeFrom(change)
        return RoutedRequest(self.payload + change.SerializeToString(), message)
