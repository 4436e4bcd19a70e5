"""One simulated pod's disk tier: copies of remote adapters, bounded in bytes, least recently used first, as the
real one keeps them (data_plane/lora/disk_tier.py). A download reserves its bytes when it starts and makes room
by dropping the least recently used copies, never one whose download runs; a prefetch takes free room only."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable


class DiskTier:
    def __init__(self, capacity: int, size_of: Callable[[str], int]) -> None:
        self.capacity = capacity
        self.used = 0  # bytes of its copies, downloads in flight included
        self.copies: OrderedDict[str, bool] = OrderedDict()  # LRU first; False while its download runs
        self._size_of = size_of
        self._version = 0  # changes whenever the set of ready copies does
        self._reported: tuple[int, frozenset[int]] = (-1, frozenset())

    def __contains__(self, name: str) -> bool:
        return name in self.copies

    def __len__(self) -> int:
        return len(self.copies)

    def ready(self, name: str) -> bool:
        return self.copies.get(name, False)

    def fits(self, name: str) -> bool:
        """Whether a copy of ``name`` fits in free room, evicting nothing."""
        return self.used + self._size_of(name) <= self.capacity

    def used_now(self, name: str) -> None:
        self.copies.move_to_end(name)

    def reserve(self, name: str) -> bool:
        """Room for a download of ``name``, dropping least recently used copies as needed; False when it does not
        fit even so (the room is held by downloads in flight): the download is then not kept."""
        size = self._size_of(name)
        while self.used + size > self.capacity:
            victim = next((a for a, ready in self.copies.items() if ready), None)
            if victim is None:
                return False
            del self.copies[victim]
            self.used -= self._size_of(victim)
            self._version += 1
        self.copies[name] = False
        self.used += size
        return True

    def landed(self, name: str) -> None:
        """The download of ``name`` finished: its copy is ready."""
        if name in self.copies:
            self.copies[name] = True
            self._version += 1

    def keys(self, key_of: dict[str, int]) -> frozenset[int]:
        """The ready copies by disk key (what GetState reports in PodState.disk_digests); rebuilt only after a
        change."""
        if self._reported[0] != self._version:
            self._reported = (self._version, frozenset(key_of[a] for a, ready in self.copies.items() if ready))
        return self._reported[1]

    def problems(self) -> list[str]:
        out = []
        if self.used > self.capacity:
            out.append(f"{self.used} bytes in a disk tier of {self.capacity}")
        if self.used != sum(map(self._size_of, self.copies)):
            out.append("the disk tier's bytes disagree with its copies")
        return out
