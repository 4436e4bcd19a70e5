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

MAX_CACHE_SALT = 256  # characters of a caller's cache_salt, as the HTTP door takes it


@dataclass(frozen=True)
class RoutedRequest:
    """A request on its way to a pod: the bytes it is forwarded as, and the message they hold."""

    payload: bytes  # the serialized GenerateRequest a pod receives
    message: generation_pb2.GenerateRequest  # what ``payload`` parses to

    @classmethod
    def parse(cls, payload: bytes) -> RoutedRequest:
        """The request ``payload`` holds; InvalidRequest if it is not a GenerateRequest."""
        try:
            message = generation_pb2.GenerateRequest.FromString(payload)
        except DecodeError as e:
            raise InvalidRequest(f"the request is not a lorafleet.v1.GenerateRequest ({e}); "
                                 "send one built from protos/lorafleet/v1/generation.proto") from None
        if len(message.cache_salt) > MAX_CACHE_SALT:
            raise InvalidRequest(f"cache_salt has {len(message.cache_salt)} characters; send at most {MAX_CACHE_SALT}")
        return cls(payload, message)

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

    def for_open_door(self) -> RoutedRequest:
        """The same request with the caller's cache salt, if any, under the open doors' own scope: a caller no
        key names cannot claim a tenant's scope (``tenant:acme``) on pods that a router with tenants also
        serves."""
        if not self.message.cache_salt:
            return self
        return self._with(generation_pb2.GenerateRequest(cache_salt=f"open/{self.message.cache_salt}"))

    def for_tenant(self, tenant: str, cache_scope: str) -> RoutedRequest:
        """The same request with ``tenant`` named, whatever the caller wrote there (the pods' fair shares weigh
        the tenant a guarded door authenticated), and its cache salt under ``cache_scope`` (the tenant's, or
        its sharing group's), followed by the caller's own salt: no other scope's requests share its cached
        prompt blocks."""
        salt = f"{cache_scope}/{self.message.cache_salt}" if self.message.cache_salt else cache_scope
        return self._with(generation_pb2.GenerateRequest(tenant=tenant, cache_salt=salt))

    def _with(self, change: generation_pb2.GenerateRequest) -> RoutedRequest:
        """``change``'s fields over this request's, appended to its bytes (a later value of a field wins)."""
        message = generation_pb2.GenerateRequest()
        message.CopyFrom(self.message)
        message.MergeFrom(change)
        return RoutedRequest(self.payload + change.SerializeToString(), message)
