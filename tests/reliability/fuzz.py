"""Property-based fuzzing of gRPC services from their descriptors: every method of a service, and a
hypothesis strategy that fills every field of its request message (nested messages, repeated fields
and oneofs included) with arbitrary and adversarial values."""

from __future__ import annotations

import dataclasses

import grpc
from google.protobuf import descriptor, message_factory
from hypothesis import strategies as st

FD = descriptor.FieldDescriptor
# Values that reach interesting code: known and hostile adapter names, paths out of the roots, URLs.
ADVERSARIAL = ["", " ", "pirate", "shouty", "signoff", "truncated", "huge-file", "evil-pickle", "tensor-pickle",
               "symlink-escape", "nan", "../../../../etc/passwd", "/etc", "file:///etc/passwd",
               "http://127.0.0.1:1/adapter", "s3://bucket/adapter", "a" * 300, "\x00", "é" * 40, "0" * 64,
               "system", "user", "assistant"]
_INTS = {FD.TYPE_INT32: (-2**31, 2**31 - 1), FD.TYPE_SINT32: (-2**31, 2**31 - 1), FD.TYPE_SFIXED32: (-2**31, 2**31 - 1),
         FD.TYPE_UINT32: (0, 2**32 - 1), FD.TYPE_FIXED32: (0, 2**32 - 1), FD.TYPE_INT64: (-2**63, 2**63 - 1),
         FD.TYPE_SINT64: (-2**63, 2**63 - 1), FD.TYPE_SFIXED64: (-2**63, 2**63 - 1), FD.TYPE_UINT64: (0, 2**64 - 1),
         FD.TYPE_FIXED64: (0, 2**64 - 1)}
MAX_DEPTH = 3


@dataclasses.dataclass(frozen=True)
class Rpc:
    path: str  # /package.Service/Method
    name: str
    input: type
    output: type
    server_streaming: bool


def rpcs(module, service: str) -> list[Rpc]:
    """Every method of ``service`` in the generated ``module``."""
    s = module.DESCRIPTOR.services_by_name[service]
    return [Rpc(f"/{s.full_name}/{m.name}", m.name, message_factory.GetMessageClass(m.input_type),
                message_factory.GetMessageClass(m.output_type), m.server_streaming) for m in s.methods]


def call_rpc(channel: grpc.Channel, rpc: Rpc, message, metadata, timeout: float) -> grpc.StatusCode:
    """The status ``rpc(message)`` ends with; a stream counts as OK once its first message arrives."""
    try:
        if rpc.server_streaming:
            call = channel.unary_stream(rpc.path, request_serializer=rpc.input.SerializeToString,
                                        response_deserializer=rpc.output.FromString)(
                message, metadata=metadata, timeout=timeout)
            try:
                next(call, None)
            finally:
                call.cancel()
        else:
            channel.unary_unary(rpc.path, request_serializer=rpc.input.SerializeToString,
                                response_deserializer=rpc.output.FromString)(
                message, metadata=metadata, timeout=timeout)
    except grpc.RpcError as e:
        return e.code()
    return grpc.StatusCode.OK


def _value(field: descriptor.FieldDescriptor, depth: int) -> st.SearchStrategy:
    t = field.type
    if t == FD.TYPE_MESSAGE:
        return request_strategy(message_factory.GetMessageClass(field.message_type), depth + 1)
    if t == FD.TYPE_STRING:
        return st.one_of(st.sampled_from(ADVERSARIAL), st.text(max_size=64))
    if t == FD.TYPE_BYTES:
        return st.binary(max_size=64)
    if t == FD.TYPE_BOOL:
        return st.booleans()
    if t in (FD.TYPE_FLOAT, FD.TYPE_DOUBLE):
        return st.floats(width=32 if t == FD.TYPE_FLOAT else 64)
    if t == FD.TYPE_ENUM:  # proto3 enums are open: unknown numbers arrive too
        return st.one_of(st.sampled_from([v.number for v in field.enum_type.values]), st.integers(-3, 1000))
    lo, hi = _INTS[t]
    return st.one_of(st.integers(lo, hi), st.integers(0, 64), st.sampled_from([lo, hi]))


def request_strategy(cls: type, depth: int = 0, fixed: dict | None = None) -> st.SearchStrategy:
    """Messages of ``cls`` with any subset of fields set to arbitrary values (nesting bounded);
    ``fixed`` maps field names to the strategies to use for them instead."""
    fields = {}
    for f in cls.DESCRIPTOR.fields:
        if f.type == FD.TYPE_MESSAGE and depth >= MAX_DEPTH:
            continue
        value = fixed[f.name] if fixed and f.name in fixed else _value(f, depth)
        fields[f.name] = st.lists(value, max_size=4) if f.is_repeated else value
    return st.fixed_dictionaries({}, optional=fields).map(lambda values: _build(cls, values))


def _build(cls: type, values: dict):
    message = cls()
    for name, value in values.items():
        field = cls.DESCRIPTOR.fields_by_name[name]
        target = getattr(message, name) if field.type == FD.TYPE_MESSAGE or field.is_repeated else None
        if field.type == FD.TYPE_MESSAGE and field.message_type.GetOptions().map_entry:  # map<K, V>: its entries
            for entry in value:
                if entry.DESCRIPTOR.fields_by_name["value"].type == FD.TYPE_MESSAGE:
                    target[entry.key].CopyFrom(entry.value)
                else:
                    target[entry.key] = entry.value
        elif field.is_repeated and field.type == FD.TYPE_MESSAGE:
            for item in value:
                target.add().CopyFrom(item)
        elif field.is_repeated:
            target.extend(value)
        elif field.type == FD.TYPE_MESSAGE:
            target.CopyFrom(value)
        else:
            setattr(message, name, value)
    return message
