"""Fixed-size KV-cache blocks handed out to sequences and taken back, and the block table.

The block table is one int32 tensor, a row per sequence holding blocks: row ``r``'s column ``j`` is
the block of its sequence's positions ``j * block_size ..``. It is updated as blocks are appended,
never rebuilt; the entries appended since the last step are kept (``take_appended``) so that a
device copy of the table can be updated with them alone.
"""

from __future__ import annotations

import torch

from data_plane.engine.sequence import Sequence


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, max_seqs: int = 256, max_blocks_per_seq: int = 0) -> None:
        """``max_seqs``: most sequences holding blocks at once; ``max_blocks_per_seq``: most blocks one
        sequence holds (0: every block)."""
        self.num_blocks = num_blocks
        self.block_size = block_size
        self._free = list(range(num_blocks - 1, -1, -1))  # a stack: freshly freed blocks are reused first
        self.table = torch.zeros(max_seqs, max_blocks_per_seq or num_blocks, dtype=torch.int32)  # [rows, blocks]
        self._free_rows = list(range(max_seqs - 1, -1, -1))
        self._appended: dict[tuple[int, int], int] = {}  # (row, column) -> block, since take_appended

    @property
    def usage(self) -> float:
        return 1.0 - len(self._free) / self.num_blocks

    @property
    def max_blocks_per_seq(self) -> int:
        return self.table.shape[1]

    def blocks_needed(self, seq: Sequence, num_new: int) -> int:
        total = seq.num_computed + num_new
        return max(0, -(-total // self.block_size) - len(seq.block_table))

    def can_allocate(self, seq: Sequence, num_new: int) -> bool:
        need = self.blocks_needed(seq, num_new)
        return need <= len(self._free) and (need == 0 or seq.kv_row >= 0 or bool(self._free_rows))

    def allocate(self, seq: Sequence, num_new: int) -> None:
        """Gives ``seq`` enough blocks to hold ``num_new`` more tokens."""
        need = self.blocks_needed(seq, num_new)
        if need == 0:
            return
        if not self.can_allocate(seq, num_new):
            raise RuntimeError("allocate() called without can_allocate()")
        first = len(seq.block_table)
        if first + need > self.max_blocks_per_seq:
            raise RuntimeError(f"a sequence needs {first + need} blocks; the table holds {self.max_blocks_per_seq}")
        if seq.kv_row < 0:
            seq.kv_row = self._free_rows.pop()
        new = [self._free.pop() for _ in range(need)]
        self.table[seq.kv_row, first : first + need] = torch.tensor(new, dtype=torch.int32)
        for col, block in enumerate(new, first):
            self._appended[seq.kv_row, col] = block
        seq.block_table += new

    def free(self, seq: Sequence) -> None:
        self._free.extend(reversed(seq.block_table))
        if seq.kv_row >= 0:
            for col in range(len(seq.block_table)):
                self._appended.pop((seq.kv_row, col), None)
            self._free_rows.append(seq.kv_row)
        seq.block_table = []
        seq.kv_row = -1
        seq.num_computed = 0

    def take_appended(self) -> list[tuple[int, int, int]]:
        """(row, column, block) of every table entry written since the last call, of sequences that still
        hold them."""
        out = [(row, col, block) for (row, col), block in self._appended.items()]
        self._appended.clear()
        return out
