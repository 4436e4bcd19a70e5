"""A step's model inputs, built by tensor ops into preallocated buffers with one host->device copy.

Per step the host knows, for each scheduled sequence: its block-table row, its computed tokens, its
new tokens, its adapter slot and whether it samples. From those few integers per sequence this
builds, without a Python loop per token, the input ids, positions, the attention inputs (slot
mapping, block tables, context lengths, query offsets), the LoRA metadata and the rows to sample;
writes them into one ``StepBuffer`` and uploads it once. The device keeps its own copy of the block
table, updated with the entries appended since the last step (``BlockManager.take_appended``).

A step may be padded to a larger sequence count (``pad_to``, for a CUDA graph captured at that size):
padding sequences have one token each, context length 0 (attention writes zeros), no adapter, and
write their keys and values to the cache's pad slot. A step with prompt tokens is padded to a token
count as well (``pad_tokens``): the first padding sequence then holds every padding token (none, one,
or a chunk with no context, whose rows attention writes as zeros too) and the others none.
"""

from __future__ import annotations

from array import array
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, replace
from itertools import chain
from typing import NamedTuple

import torch

from data_plane.engine.block_manager import BlockManager
from data_plane.model.attention import AttentionInputs, KVCache
from kernels.lora_meta import LoraMeta, LoraMetaBuilder
from kernels.step_buffer import StepBuffer


class SeqStep(NamedTuple):
    """One sequence's share of a step: ``num_new`` tokens from position ``start``. (A tuple: a step
    makes one per sequence, and the builder reads them all into one tensor.)"""

    row: int  # its block-table row
    start: int  # tokens already in the cache
    num_new: int
    slot: int  # adapter slot, -1 = base model
    samples: bool  # whether a next token is sampled after its last new token


def host_ints(values: Iterable[int], dtype: torch.dtype = torch.int64) -> torch.Tensor:
    """A host tensor of ``values`` (int64 or int32), through an array: torch.tensor converts a list of
    Python ints element by element, several times slower at a step's few hundred."""
    buffer = array("q" if dtype == torch.int64 else "i", values)
    return torch.frombuffer(buffer, dtype=dtype) if buffer else torch.empty(0, dtype=dtype)


_PAD = SeqStep(0, 0, 1, -1, False)  # a padding sequence: one token, no context, no adapter, samples nothing


@dataclass(frozen=True)
class StepInputs:
    input_ids: torch.Tensor  # [num_tokens] int32
    positions: torch.Tensor  # [num_tokens] int32
    attn: AttentionInputs
    lora: LoraMeta | None  # None: no LoRA layers in the model
    sample_rows: torch.Tensor  # [num_samples] int32, token row of each sampled sequence, in step order
    num_seqs: int  # real sequences (the first ones); the rest up to attn.seq_lens' length are padding
    num_tokens: int  # real tokens (the first ones)

    @property
    def decode_only(self) -> bool:
        return self.attn.max_query_len == 1

    def clone(self) -> StepInputs:
        """A copy in tensors of its own: the builder's buffers are rewritten by every later step."""
        attn = replace(self.attn, **{f: getattr(self.attn, f).clone() for f in
                                     ("slot_mapping", "block_tables", "seq_lens", "query_start")})
        lora = self.lora and replace(self.lora, **{
            f: getattr(self.lora, f).clone() for f in ("token_slots", "sorted_tokens", "seg_slots", "seg_starts")})
        return replace(self, input_ids=self.input_ids.clone(), positions=self.positions.clone(), attn=attn,
                       lora=lora, sample_rows=self.sample_rows.clone())


class StepInputBuilder:
    def __init__(self, blocks: BlockManager, kv_cache: KVCache, max_seqs: int, max_tokens: int,
                 device: torch.device | str, lora_meta: type[LoraMetaBuilder] | None = None, max_loras: int = 0,
                 max_rank: int = 0, separate: bool | None = None, lora_partial_rows: int = 0) -> None:
        """``max_seqs`` and ``max_tokens`` bound a step (padding included); ``lora_meta`` (with
        ``max_loras``, ``max_rank``, ``lora_partial_rows``) builds the LoRA metadata, None for a model
        without LoRA layers;
        ``separate``: whether the device keeps copies of its own (``StepBuffer``; default: off the CPU)."""
        self.blocks = blocks
        self.kv_cache = kv_cache
        self.block_size = kv_cache.block_size
        self.max_seqs = max_seqs
        self.max_tokens = max_tokens = max(max_tokens, max_seqs)
        device = torch.device(device)
        # Appended entries of one step: at most one partial block per sequence plus the new tokens' blocks.
        self.max_appends = 2 * max_seqs + -(-max_tokens // self.block_size)
        sections = {"input_ids": max_tokens, "positions": max_tokens, "slot_mapping": max_tokens,
                    "seq_lens": max_seqs, "query_start": max_seqs + 1, "rows": max_seqs, "sample_rows": max_seqs,
                    "appends": 3 * self.max_appends}
        if lora_meta is not None:
            sections |= lora_meta.sections(max_tokens, max_loras)
        self.buffer = StepBuffer(sections, device, separate)
        self.lora = (lora_meta(max_tokens, max_loras, device, max_rank, step_buffer=self.buffer,
                               partial_rows=lora_partial_rows)
                     if lora_meta is not None else None)
        on_host = self.buffer.device is self.buffer.host
        self.device_table = blocks.table if on_host else blocks.table.to(device, copy=True)  # [rows, max_blocks]
        self._block_tables = torch.zeros(max_seqs, blocks.max_blocks_per_seq, dtype=torch.int32, device=device)
        self._slot_mapping = torch.zeros(max_tokens, dtype=torch.int64, device=device)  # index_copy_ takes int64
        self._arange = torch.arange(max_tokens)  # [max_tokens] on the host: 0, 1, ...

    def build(self, seqs: Sequence[SeqStep], token_ids: Sequence[int], pad_to: int | None = None,
              pad_tokens: int | None = None) -> StepInputs:
        """The inputs of a step over ``seqs``, whose tokens (``token_ids``: each sequence's new tokens, one
        sequence after another) are laid out in that order; padded to ``pad_to`` sequences and, where
        given, ``pad_tokens`` tokens (else one token a padding sequence)."""
        num_seqs = len(seqs)
        padded = max(pad_to or num_seqs, num_seqs)
        if padded > self.max_seqs:
            raise ValueError(f"step has {padded} sequences; the buffers hold {self.max_seqs}")
        per_seq = host_ints(chain.from_iterable((*seqs, *[_PAD] * (padded - num_seqs)))).view(padded, 5)
        rows, starts, qlens, slots, samples = per_seq.unbind(1)  # [padded] each (views of per_seq)
        if pad_tokens is not None and pad_tokens != len(token_ids) + padded - num_seqs:
            if padded == num_seqs or pad_tokens < len(token_ids):
                raise ValueError(f"cannot pad a step of {num_seqs} sequences and {len(token_ids)} tokens to "
                                 f"{padded} sequences and {pad_tokens} tokens")
            qlens[num_seqs:] = 0
            qlens[num_seqs] = pad_tokens - len(token_ids)
        seq_lens = starts + qlens
        seq_lens[num_seqs:] = 0  # padding: no context
        query_start = torch.zeros(padded + 1, dtype=torch.int64)
        torch.cumsum(qlens, 0, out=query_start[1:])
        num_tokens = int(query_start[-1])
        if num_tokens > self.max_tokens:
            raise ValueError(f"step has {num_tokens} tokens; the buffers hold {self.max_tokens}")
        real_tokens = int(query_start[num_seqs])
        # One token a sequence (decodes, padding included): token t is sequence t's.
        one_each = num_tokens == padded and real_tokens == num_seqs
        if one_each:
            positions = starts.clone()
        else:
            seq_of_token = torch.repeat_interleave(self._arange[:padded], qlens, output_size=num_tokens)  # [num_tokens]
            positions = starts[seq_of_token] + self._arange[:num_tokens] - query_start[seq_of_token]
        bs = self.block_size
        token_rows = rows if one_each else rows[seq_of_token]  # [num_tokens]
        slot_mapping = self.blocks.table[token_rows, positions // bs].long() * bs + positions % bs
        slot_mapping[real_tokens:] = self.kv_cache.pad_slot
        positions[real_tokens:] = 0

        self.buffer.wait_for_upload()
        host = self.buffer.host_view
        if len(token_ids) != real_tokens:
            raise ValueError(f"the step's sequences have {real_tokens} new tokens but {len(token_ids)} token ids")
        host("input_ids")[:num_tokens] = 0
        host("input_ids")[:real_tokens] = host_ints(token_ids, torch.int32)
        host("positions")[:num_tokens] = positions
        host("slot_mapping")[:num_tokens] = slot_mapping
        host("seq_lens")[:padded] = seq_lens
        host("query_start")[: padded + 1] = query_start
        host("rows")[:padded] = rows
        sample_rows = (query_start[1:] - 1)[samples.bool()]
        host("sample_rows")[: sample_rows.shape[0]] = sample_rows
        num_appends = self._stage_appends()
        # A step without adapter tokens builds no LoRA metadata: its forward runs (and replays) without LoRA.
        lora = (self.lora.build(slots if one_each else slots[seq_of_token])
                if self.lora is not None and bool((slots >= 0).any()) else None)
        self.buffer.upload()

        dev = self.buffer.device_view
        if num_appends > 0:
            appends = dev("appends")[: 3 * num_appends].view(num_appends, 3).long()
            self.device_table[appends[:, 0], appends[:, 1]] = appends[:, 2].int()
        elif num_appends < 0:  # more than the section holds: the whole table
            self.device_table.copy_(self.blocks.table, non_blocking=True)
        block_tables = self._block_tables[:padded]
        torch.index_select(self.device_table, 0, dev("rows")[:padded], out=block_tables)
        slot_mapping = self._slot_mapping[:num_tokens]
        slot_mapping.copy_(dev("slot_mapping")[:num_tokens])
        attn = AttentionInputs(
            slot_mapping=slot_mapping, block_tables=block_tables, seq_lens=dev("seq_lens")[:padded],
            query_start=dev("query_start")[: padded + 1], max_query_len=int(qlens.max()),
            max_seq_len=max(1, int(seq_lens.max())), block_size=bs,
        )
        return StepInputs(dev("input_ids")[:num_tokens], dev("positions")[:num_tokens], attn, lora,
                          dev("sample_rows")[: sample_rows.shape[0]], num_seqs, real_tokens)

    def _stage_appends(self) -> int:
        """Stages the block-table entries appended since the last step for the device's copy; returns
        their count, 0 where the device reads the host table itself, -1 when they do not fit."""
        appended = self.blocks.take_appended()
        if self.device_table is self.blocks.table or not appended:
            return 0
        if len(appended) > self.max_appends:
            return -1
        self.buffer.host_view("appends")[: 3 * len(appended)] = torch.tensor(appended, dtype=torch.int32).reshape(-1)
        return len(appended)
