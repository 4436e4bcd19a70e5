"""Hand-built steps for model tests: each sequence's block table, cached and new tokens, laid out
as the engine's step builder lays them out (one sequence's new tokens after another's)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from data_plane.model.attention import AttentionInputs


@dataclass(frozen=True)
class SeqSlice:
    block_table: list[int]
    num_cached: int
    num_new: int


def attention_inputs(seqs: list[SeqSlice], block_size: int, device: str | torch.device = "cpu") -> AttentionInputs:
    for s in seqs:
        if len(s.block_table) * block_size < s.num_cached + s.num_new:
            raise ValueError(f"{s} owns too few blocks")
    width = max(len(s.block_table) for s in seqs)
    tables = torch.zeros(len(seqs), width, dtype=torch.int32)
    slots, starts = [], [0]
    for b, s in enumerate(seqs):
        tables[b, : len(s.block_table)] = torch.tensor(s.block_table)
        for p in range(s.num_cached, s.num_cached + s.num_new):
            slots.append(s.block_table[p // block_size] * block_size + p % block_size)
        starts.append(starts[-1] + s.num_new)
    lens = [s.num_cached + s.num_new for s in seqs]
    return AttentionInputs(
        slot_mapping=torch.tensor(slots, dtype=torch.int64, device=device), block_tables=tables.to(device),
        seq_lens=torch.tensor(lens, dtype=torch.int32, device=device),
        query_start=torch.tensor(starts, dtype=torch.int32, device=device),
        max_query_len=max(s.num_new for s in seqs), max_seq_len=max(lens), block_size=block_size)


def positions(seqs: list[SeqSlice]) -> torch.Tensor:
    return torch.cat([torch.arange(s.num_cached, s.num_cached + s.num_new) for s in seqs])
