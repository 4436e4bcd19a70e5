"""Fixed-size KV-cache blocks handed out to sequences and taken back."""

from __future__ import annotations

from data_plane.engine.sequence import Sequence


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int) -> None:
        self.num_blocks = num_blocks
        self.block_size = block_size
        self._free = list(range(num_blocks - 1, -1, -1))  # a stack: freshly freed blocks are reused first

    @property
    def usage(self) -> float:
        return 1.0 - len(self._free) / self.num_blocks

    def blocks_needed(self, seq: Sequence, num_new: int) -> int:
        total = seq.num_computed + num_new
        return max(0, -(-total // self.block_size) - len(seq.block_table))

    def can_allocate(self, seq: Sequence, num_new: int) -> bool:
        return self.blocks_needed(seq, num_new) <= len(self._free)

    def allocate(self, seq: Sequence, num_new: int) -> None:
        """Gives ``seq`` enough blocks to hold ``num_new`` more tokens."""
        need = self.blocks_needed(seq, num_new)
        if need > len(self._free):
            raise RuntimeError("allocate() called without can_allocate()")
        for _ in range(need):
            seq.block_table.append(self._free.pop())

    def free(self, seq: Sequence) -> None:
        self._free.extend(reversed(seq.block_table))
        seq.block_table = []
        seq.num_computed = 0
