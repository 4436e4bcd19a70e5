"""Full KV blocks kept after their sequences end, found again by what they hold.

A full block's key is (the key of the block before it, the sequence's salt, its tokens): so a block
matches only after the same tokens, under the same adapter content and precision (the salt: the
adapter's weights sha256, or "" for the base model, and the pod's precision). Keys name content, not
blocks: each distinct content gets one id, and a block's key refers to the block before by that id,
so keys stay small however long the prefix. Ids are never reused: an evicted entry's descendants can
no longer be reached, and age out of the LRU.

The cache holds no references: the block manager counts them. A cached block nobody references is
evictable (least recently released first); one referenced is not.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

Key = tuple[int, str, tuple[int, ...]]


@dataclass
class PrefixStats:
    queried_tokens: int = 0  # prompt tokens looked up at admission
    hit_tokens: int = 0  # of those, found cached
    evictions: int = 0  # cached blocks given to another use


class PrefixCache:
    def __init__(self, block_size: int) -> None:
        self.block_size = block_size
        self._entries: dict[Key, tuple[int, int]] = {}  # key -> (content id, block)
        self._key_of: dict[int, Key] = {}  # block -> its key, for cached blocks
        self._block_of: dict[int, int] = {}  # content id -> its block, for cached contents
        self._evictable: OrderedDict[int, None] = OrderedDict()  # cached blocks with no reference, LRU first
        self._next_id = 1  # 0 names the empty prefix
        self.stats = PrefixStats()

    @property
    def num_cached(self) -> int:
        return len(self._key_of)

    @property
    def num_evictable(self) -> int:
        return len(self._evictable)

    def is_cached(self, block: int) -> bool:
        return block in self._key_of

    def holds(self, content: int) -> bool:
        """Whether the content ``content`` names is still cached (ids are never reused, so once evicted, never)."""
        return content in self._block_of

    def match(self, salt: str, tokens: Sequence[int], limit: int) -> list[tuple[int, int]]:
        """(content id, block) of the cached blocks holding ``tokens`` from the start, as many full blocks
        as are cached in a row, covering at most ``limit`` tokens."""
        bs, parent, out = self.block_size, 0, []
        for start in range(0, limit - limit % bs, bs):
            entry = self._entries.get((parent, salt, tuple(tokens[start : start + bs])))
            if entry is None:
                break
            out.append(entry)
            parent = entry[0]
        return out

    def insert(self, parent: int, salt: str, tokens: Sequence[int], block: int) -> int:
        """Records that ``block`` holds ``tokens`` after the content ``parent``; returns the content's id.
        When that content is cached already (another sequence computed it), ``block`` stays uncached."""
        key = (parent, salt, tuple(tokens))
        entry = self._entries.get(key)
        if entry is not None:
            return entry[0]
        content = self._next_id
        self._next_id += 1
        self._entries[key] = (content, block)
        self._key_of[block] = key
        self._block_of[content] = block
        return content

    def record_lookup(self, tokens: int, hit: int) -> None:
        """Counts an admitted sequence's lookup: its ``tokens`` tokens, ``hit`` of them found cached."""
        self.stats.queried_tokens += tokens
        self.stats.hit_tokens += hit

    def referenced(self, block: int) -> None:
        """A cached block gained its first reference: it is no longer evictable."""
        self._evictable.pop(block, None)

    def released(self, block: int) -> None:
        """A cached block lost its last reference: evictable, the most recently released last."""
        self._evictable[block] = None

    def evict(self) -> int | None:
        """Forgets the least recently released unreferenced block and returns it; None when there is none."""
        if not self._evictable:
            return None
        block, _ = self._evictable.popitem(last=False)
        content, _ = self._entries.pop(self._key_of.pop(block))
        del self._block_of[content]
        self.stats.evictions += 1
        return block
