"""Fixed-size KV-cache blocks handed out to sequences and taken back, and the block table.

Blocks are reference-counted: with prefix caching (``PrefixCache``) a full block another sequence
computed is shared by every sequence whose prompt begins with the same tokens under the same adapter
and precision, and it outlives them, evictable once unreferenced, until its block is needed again.

The block table is one int32 tensor, a row per sequence holding blocks: row ``r``'s column ``j`` is
the block of its sequence's positions ``j * block_size ..``. It is updated as blocks are appended,
never rebuilt; the entries appended since the last step are kept (``take_appended``) so that a
device copy of the table can be updated with them alone.
"""

from __future__ import annotations

import torch

from data_plane.engine.prefix_cache import PrefixCache
from data_plane.engine.sequence import Sequence


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, max_seqs: int = 256, max_blocks_per_seq: int = 0,
                 prefix_caching: bool = False) -> None:
        """``max_seqs``: most sequences holding blocks at once; ``max_blocks_per_seq``: most blocks one
        sequence holds (0: every block); ``prefix_caching``: full blocks are kept and shared by content."""
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.prefix = PrefixCache(block_size) if prefix_caching else None
        self._refs = [0] * num_blocks  # sequences holding each block
        self._free = list(range(num_blocks - 1, -1, -1))  # a stack: freshly freed blocks are reused first
        self.table = torch.zeros(max_seqs, max_blocks_per_seq or num_blocks, dtype=torch.int32)  # [rows, blocks]
        self._free_rows = list(range(max_seqs - 1, -1, -1))
        self._appended: dict[tuple[int, int], int] = {}  # (row, column) -> block, since take_appended

    @property
    def num_available(self) -> int:
        """Blocks a sequence can be given: free ones and cached ones nobody holds."""
        return len(self._free) + (self.prefix.num_evictable if self.prefix else 0)

    @property
    def usage(self) -> float:
        return 1.0 - self.num_available / self.num_blocks

    @property
    def max_blocks_per_seq(self) -> int:
        return self.table.shape[1]

    def blocks_needed(self, seq: Sequence, num_new: int) -> int:
        total = seq.num_computed + num_new
        return max(0, -(-total // self.block_size) - len(seq.block_table))

    def room(self, seq: Sequence) -> int:
        """The most tokens ``seq`` can compute next in its own blocks and those available now."""
        return max(0, (len(seq.block_table) + self.num_available) * self.block_size - seq.num_computed)

    def can_allocate(self, seq: Sequence, num_new: int) -> bool:
        need = self.blocks_needed(seq, num_new)
        return need <= self.num_available and (need == 0 or seq.kv_row >= 0 or bool(self._free_rows))

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
        new = [self._free.pop() if self._free else self.prefix.evict() for _ in range(need)]
        for block in new:
            self._refs[block] = 1
        self._append(seq, new)

    def match_prefix(self, seq: Sequence, salt: str) -> int:
        """Gives a sequence that holds no blocks the cached blocks its tokens begin with (all but its last
        token may come from the cache: that one's logits are needed); returns how many tokens they hold.
        The sequence's ``num_computed`` is not changed: the step's postprocess adds them."""
        if self.prefix is None or seq.block_table:
            return 0
        seq.cache_salt = salt
        tokens = seq.all_ids
        matched = self.prefix.match(salt, tokens, len(tokens) - 1)
        if not matched or (seq.kv_row < 0 and not self._free_rows):
            return 0
        for content, block in matched:
            if self._refs[block] == 0:
                self.prefix.referenced(block)
            self._refs[block] += 1
            seq.prefix_ids.append(content)
        self._append(seq, [block for _, block in matched])
        return len(matched) * self.block_size

    def cache_full_blocks(self, seq: Sequence) -> None:
        """Records the sequence's full, computed blocks whose token ids the host holds (none pending) in the
        prefix cache (call after its progress advanced, or a pending token settled); blocks whose content is
        cached already stay the sequence's own."""
        if self.prefix is None:
            return
        bs = self.block_size
        for i in range(len(seq.prefix_ids), min(min(seq.num_computed, seq.num_known) // bs, len(seq.block_table))):
            parent = seq.prefix_ids[-1] if seq.prefix_ids else 0
            seq.prefix_ids.append(self.prefix.insert(parent, seq.cache_salt, seq.token_slice(i * bs, (i + 1) * bs),
                                                     seq.block_table[i]))

    def _append(self, seq: Sequence, new: list[int]) -> None:
        first = len(seq.block_table)
        if seq.kv_row < 0:
            seq.kv_row = self._free_rows.pop()
        self.table[seq.kv_row, first : first + len(new)] = torch.tensor(new, dtype=torch.int32)
        for col, block in enumerate(new, first):
            self._appended[seq.kv_row, col] = block
        seq.block_table += new

    def free(self, seq: Sequence) -> None:
        """Takes back every block and the table row ``seq`` holds. Its progress (``num_computed``) is left
        as it is: the step's postprocess (``Scheduler.postprocess``) is its one writer."""
        for block in reversed(seq.block_table):
            self._refs[block] -= 1
            if self._refs[block]:
                continue
            if self.prefix is not None and self.prefix.is_cached(block):
                self.prefix.released(block)
            else:
                self._free.append(block)
        seq.prefix_ids = []
        if seq.kv_row >= 0:
            for col in range(len(seq.block_table)):
                self._appended.pop((seq.kv_row, col), None)
            self._free_rows.append(seq.kv_row)
        seq.block_table = []
        seq.kv_row = -1

    def take_appended(self) -> list[tuple[int, int, int]]:
        """(row, column, block) of every table entry written since the last call, of sequences that still
        hold them."""
        out = [(row, col, block) for (row, col), block in self._appended.items()]
        self._appended.clear()
        return out
