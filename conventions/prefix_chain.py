"""The routing prefix of a Generate request: a chain of 64-bit hashes over its input as the caller sent it,
one per full ``CHUNK_BYTES`` chunk, that the router and the pods compute alike.

The router forwards request bytes and has no tokenizer or chat template, so it cannot name the pods' KV
blocks (keyed by token ids and adapter content). Both sides can read the request itself, though: the
input is laid out as bytes (the raw prompt, or the tools and each chat turn's fields, in order), cut into
fixed-size chunks, and chunk ``i``'s hash covers the adapter's name, the request's cache salt and every
byte up to the chunk's end (``h[i] = H(h[i-1] || chunk[i])``, ``h[-1] = H(adapter, salt)``). So two
requests share hash ``i`` exactly when they name the same adapter and salt (GenerateRequest.cache_salt: a
tenant's cache scope) and their inputs agree on the first ``(i + 1) * CHUNK_BYTES`` bytes, and a pod that
holds the KV blocks of one holds most of the other's prefix too.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

from lorafleet.v1 import generation_pb2

# About 64 tokens of English text: fine enough that a system prompt of a few hundred tokens is several
# chunks, coarse enough that an 8k-token prompt (~32 KB) is ~128 hashes, ~0.1 ms of blake2b on one core
# (AMD EPYC, 2026-11-26), once per request on each side.
CHUNK_BYTES = 256
# Separates fields and turns; a byte no UTF-8 text holds, so no two layouts run together alike.
_SEP = b"\xff"


@dataclass(frozen=True)
class RoutingPrefix:
    """A request's chain (``hashes[i]`` covers its first ``(i + 1) * CHUNK_BYTES`` input bytes) and the
    length of that input in bytes, full chunks or not."""

    hashes: tuple[int, ...]
    input_bytes: int


def input_bytes(request: generation_pb2.GenerateRequest) -> bytes:
    """The request's input as the chain reads it: the raw prompt, or the tools followed by each turn's
    role, name, tool-call id, tool calls and content, in the order a chat template renders them."""
    kind = request.WhichOneof("input")
    if kind == "prompt":
        return b"p" + _SEP + request.prompt.encode()
    if kind == "messages":
        parts = [b"m", request.tools_json.encode()]
        for m in request.messages.messages:
            parts += [m.role.encode(), m.name.encode(), m.tool_call_id.encode(), m.tool_calls_json.encode(),
                      m.content.encode()]
        return _SEP.join(parts)
    return b""


def chain(adapter: str, data: bytes, salt: str = "") -> tuple[int, ...]:
    """The hash of each full ``CHUNK_BYTES`` chunk of ``data``, each chained to the ones before it, to
    ``adapter`` ("" = the base model) and to the cache ``salt``, so that no two adapters, and no two salts,
    ever share a hash by construction."""
    seed = b"lorafleet-prefix/1" + _SEP + adapter.encode() + (_SEP + salt.encode() if salt else b"")
    h = hashlib.blake2b(seed, digest_size=8).digest()
    out = []
    for start in range(0, len(data) - CHUNK_BYTES + 1, CHUNK_BYTES):
        h = hashlib.blake2b(h + data[start : start + CHUNK_BYTES], digest_size=8).digest()
        out.append(int.from_bytes(h, "little"))
    return tuple(out)


def routing_prefix(request: generation_pb2.GenerateRequest) -> RoutingPrefix:
    """The request's routing prefix, as the router and the pod it reaches both compute it."""
    data = input_bytes(request)
    return RoutingPrefix(chain(request.adapter, data, request.cache_salt), len(data))
