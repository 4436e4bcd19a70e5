"""Which routing prefixes this pod still holds KV blocks for: what it tells routers (PodState.prefix_hashes)
so that they send a request to a pod that will find its prompt's beginning cached.

A routing prefix (conventions/prefix_chain.py) hashes the request's input bytes as the router sees them;
the prefix cache keys token blocks. When a request's prompt has been prefilled, its full blocks are in the
prefix cache, and each chain hash ``i`` is recorded with the blocks that hold the tokens of its first
``(i + 1) * CHUNK_BYTES`` input bytes, counted in proportion (input bytes to prompt tokens; the chat
template's few added tokens spread evenly), since the tokenizer does not say where a byte offset falls.
A hash is reported while every one of its blocks is still cached: a block evicted takes each hash that
needs it out of the report. The record keeps the ``capacity`` most recently recorded hashes.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

from conventions.prefix_chain import CHUNK_BYTES, RoutingPrefix
from data_plane.engine.prefix_cache import PrefixCache


class PrefixReport:
    def __init__(self, cache: PrefixCache, capacity: int) -> None:
        """``capacity``: most chain hashes kept, and so reported (the report is 8 bytes a hash)."""
        if capacity < 1:
            raise ValueError(f"a prefix report holds at least one hash, got capacity {capacity}")
        self._cache = cache
        self.capacity = capacity
        # chain hash -> (content ids of its prompt's leading blocks, shared by the prompt's hashes; how many of
        # them hold its tokens); least recent first
        self._entries: OrderedDict[int, tuple[tuple[int, ...], int]] = OrderedDict()

    def __len__(self) -> int:
        return len(self._entries)

    def record(self, prefix: RoutingPrefix, prompt_tokens: int, contents: Sequence[int]) -> None:
        """Records a prefilled prompt of ``prompt_tokens`` tokens whose routing prefix is ``prefix`` and whose
        leading full blocks are cached as ``contents`` (content ids, in order)."""
        if not prefix.hashes or not contents or prefix.input_bytes <= 0:
            return
        bs, contents = self._cache.block_size, tuple(contents)
        for i, h in enumerate(prefix.hashes):
            tokens = (i + 1) * CHUNK_BYTES * prompt_tokens // prefix.input_bytes
            blocks = min(tokens // bs, len(contents))
            if blocks == 0:  # the chunk ends inside the first block: nothing of it is findable
                continue
            self._entries[h] = (contents, blocks)
            self._entries.move_to_end(h)
        while len(self._entries) > self.capacity:
            self._entries.popitem(last=False)

    def held(self) -> list[int]:
        """The recorded hashes whose blocks are all still cached, least recent first; forgets the others."""
        cached: dict[int, int] = {}  # id of a prompt's contents -> how many of its leading blocks are cached
        out, gone = [], []
        for h, (contents, blocks) in self._entries.items():
            if id(contents) not in cached:
                cached[id(contents)] = next((i for i, c in enumerate(contents) if not self._cache.holds(c)),
                                            len(contents))
            if blocks <= cached[id(contents)]:
                out.append(h)
            else:
                gone.append(h)
        for h in gone:
            del self._entries[h]
        return out
