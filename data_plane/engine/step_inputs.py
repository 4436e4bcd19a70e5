"""A step's model inputs, built by tensor ops into preallocated buffers with one host->device copy.

Per step the host knows, for each scheduled sequence: its block-table row, its computed tokens, its
new tokens, its adapter slot and whether it samples. From those few integers per sequence, given as
columns (``build_columns``; ``build`` takes a ``SeqStep`` per sequence), this builds, without a Python
loop per token, the input ids, positions, the attention inputs (slot mapping, block tables, context
lengths, query offsets), the LoRA metadata and the rows to sample; writes them into one ``StepBuffer``
and uploads it once. The device keeps its own copy of the block table, updated with the entries
appended since the last step (``BlockManager.take_appended``). A token whose id the host does not hold
(sampled by a step whose ids are still on the device) is fed on the device from its row of a
persistent per-row tensor of ids (``fed``, ``fed_from``: ``PersistentBatch.token_ids``), after the upload.

A step may be padded to a larger sequence count (``pad_to``, for a CUDA graph captured at that size):
padding sequences have one token each, context length 0 (attention writes zeros), no adapter, and
write their keys and values to the cache's pad slot. A step with prompt tokens is padded to a token
count as well (``pad_tokens``): the first padding sequence then holds every padding token (none, one,
or a chunk with no context, whose rows attention writes as zeros too) and the others none.

Host time: a decode step (one token a sequence) takes a fixed number of tensor ops whatever its batch,
each written straight into its section of the buffer; the per-sequence work is the packing of the
columns into one host tensor.
"""

from __future__ import annotations

import struct
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import NamedTuple

import torch

from data_plane.engine.block_manager import BlockManager
from data_plane.model.attention import AttentionInputs, KVCache
from kernels.lora_meta import LoraMeta, LoraMetaBuilder
from kernels.step_buffer import StepBuffer


class SeqStep(NamedTuple):
    """One sequence's share of a step: ``num_new`` tokens from position ``start``."""

    row: int  # its block-table row
    start: int  # tokens already in the cache
    num_new: int
    slot: int  # adapter slot, -1 = base model
    samples: bool  # whether a next token is sampled after its last new token


def host_ints(values: Sequence[int], dtype: torch.dtype = torch.int64) -> torch.Tensor:
    """A host tensor of ``values`` (int64 or int32): packed by ``struct`` into one buffer, several times
    faster than torch.tensor, which converts a list of Python ints element by element."""
    values = values if isinstance(values, list | tuple) else list(values)
    if not values:
        return torch.empty(0, dtype=dtype)
    code = "q" if dtype == torch.int64 else "i"
    return torch.frombuffer(bytearray(struct.pack(f"{len(values)}{code}", *values)), dtype=dtype)


@dataclass(frozen=True)
class StepInputs:
    input_ids: torch.Tensor  # [num_tokens] int32
    positions: torch.Tensor  # [num_tokens] int32
    attn: AttentionInputs
    lora: LoraMeta | None  # None: no LoRA layers in the model
    sample_rows: torch.Tensor  # [num_samples] int32, token row of each sampled sequence, in step order
    num_seqs: int  # real sequences (the first ones); the rest up to attn.seq_lens' length are padding
    num_tokens: int  # real tokens (the first ones)
    # [num_samples] int32, the block-table row of each sampled sequence (where its sampled id is kept)
    sample_kv_rows: torch.Tensor | None = None

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
                       lora=lora, sample_rows=self.sample_rows.clone(),
                       sample_kv_rows=None if self.sample_kv_rows is None else self.sample_kv_rows.clone())


_SECTIONS = ("input_ids", "positions", "slot_mapping", "seq_lens", "query_start", "rows", "sample_rows",
             "sample_kv_rows", "feed", "appends")


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
                    "sample_kv_rows": max_seqs, "feed": 2 * max_seqs, "appends": 3 * self.max_appends}
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
        self._arange = torch.arange(max_tokens + 1)  # [max_tokens + 1] on the host: 0, 1, ...
        # Every section's whole view, made once (a view costs a step as much as a small op).
        self._host = {name: self.buffer.host_view(name) for name in _SECTIONS}
        self._dev = {name: self.buffer.device_view(name) for name in _SECTIONS}
        self._host_views: dict[tuple[str, int], torch.Tensor] = {}
        self._dev_views: dict[tuple[str, int], torch.Tensor] = {}
        self._host_ints = self.buffer.host.numpy()  # the host buffer's memory, which struct packs into
        self._byte_offset = {name: 4 * view.storage_offset() for name, view in self._host.items()}
        self._ranges = -1  # the step size whose query offsets the host buffer holds (0, 1, ...); -1: none

    def build(self, seqs: Sequence[SeqStep], token_ids: Sequence[int], pad_to: int | None = None,
              pad_tokens: int | None = None) -> StepInputs:
        """The inputs of a step over ``seqs``, whose tokens (``token_ids``: each sequence's new tokens, one
        sequence after another) are laid out in that order; padded to ``pad_to`` sequences and, where
        given, ``pad_tokens`` tokens (else one token a padding sequence)."""
        columns = [list(c) for c in zip(*seqs, strict=True)] if seqs else [[] for _ in SeqStep._fields]
        return self.build_columns(*columns, token_ids, pad_to=pad_to, pad_tokens=pad_tokens)

    def build_columns(self, rows: list[int], starts: list[int], num_new: list[int], slots: list[int],
                      samples: list[int] | list[bool], token_ids: Sequence[int], pad_to: int | None = None,
                      pad_tokens: int | None = None, fed: Sequence[int] = (), fed_from: torch.Tensor | None = None,
                      ) -> StepInputs:
        """``build`` over the step's columns (one entry per sequence each: ``SeqStep``'s fields, as lists).
        ``fed``: the token indices (into ``token_ids``, whose entries there are ignored) whose ids are read on
        the device from ``fed_from`` [rows] int32 at their sequence's row, each the last token of a one-token
        sequence (``range(len(rows))`` in a decode step whose every token is fed)."""
        num_seqs = len(rows)
        padded = max(pad_to or num_seqs, num_seqs)
        if padded > self.max_seqs:
            raise ValueError(f"step has {padded} sequences; the buffers hold {self.max_seqs}")
        pads = padded - num_seqs
        real_tokens = len(token_ids)
        one_each = num_new.count(1) == num_seqs  # one token a sequence (decodes), until padded with more
        if (num_seqs if one_each else sum(num_new)) != real_tokens:
            raise ValueError(f"the step's sequences have {sum(num_new)} new tokens but {real_tokens} token ids")
        pad_new = [1] * pads
        num_tokens = real_tokens + pads
        if pad_tokens is not None and pad_tokens != num_tokens:
            if not pads or pad_tokens < real_tokens:
                raise ValueError(f"cannot pad a step of {num_seqs} sequences and {real_tokens} tokens to "
                                 f"{padded} sequences and {pad_tokens} tokens")
            pad_new = [pad_tokens - real_tokens] + [0] * (pads - 1)
            num_tokens = pad_tokens
            one_each = False
        if num_tokens > self.max_tokens:
            raise ValueError(f"step has {num_tokens} tokens; the buffers hold {self.max_tokens}")
        num_samples = sum(samples)
        num_fed = len(fed)
        all_fed = one_each and num_fed == num_seqs  # the step's rows in place of its fed indices

        self.buffer.wait_for_upload()
        if one_each:
            token_of = None
            self._decode_layout(rows, starts, samples, token_ids, pads, num_samples, all_fed)
            max_seq_len = max(starts, default=0) + 1
        else:
            token_of = self._mixed_layout(rows, starts, num_new, pad_new, samples, token_ids, pads, real_tokens,
                                          num_tokens)
            max_seq_len = max(map(int.__add__, starts, num_new), default=1)
        if num_fed and not all_fed:
            fed_t = host_ints(fed)
            feed = self._host_view("feed", 2 * num_fed)
            feed[:num_fed] = fed_t
            feed[num_fed:] = self._host_view("rows", padded)[fed_t if one_each else token_of[fed_t]]
        num_appends = self._stage_appends()
        # A step without adapter tokens builds no LoRA metadata: its forward runs (and replays) without LoRA.
        lora = None
        if self.lora is not None and num_seqs and max(slots) >= 0:
            slots_t = host_ints([*slots, *([-1] * pads)])
            lora = self.lora.build(slots_t if one_each else slots_t[token_of])
        self.buffer.upload()

        dev = self._dev_view
        if num_appends > 0:
            appends = dev("appends", 3 * num_appends).view(num_appends, 3).long()
            self.device_table[appends[:, 0], appends[:, 1]] = appends[:, 2].int()
        elif num_appends < 0:  # more than the section holds: the whole table
            self.device_table.copy_(self.blocks.table, non_blocking=True)
        block_tables = self._block_tables[:padded]
        torch.index_select(self.device_table, 0, dev("rows", padded), out=block_tables)
        slot_mapping = self._slot_mapping[:num_tokens]
        slot_mapping.copy_(dev("slot_mapping", num_tokens))
        input_ids = dev("input_ids", num_tokens)
        if all_fed:
            torch.index_select(fed_from, 0, dev("rows", num_seqs), out=dev("input_ids", num_seqs))
        elif num_fed:
            feed = dev("feed", 2 * num_fed)
            input_ids[feed[:num_fed]] = fed_from[feed[num_fed:]]
        attn = AttentionInputs(
            slot_mapping=slot_mapping, block_tables=block_tables, seq_lens=dev("seq_lens", padded),
            query_start=dev("query_start", padded + 1),
            max_query_len=1 if one_each else max(max(num_new, default=1), pad_new[0] if pads else 1),
            max_seq_len=max_seq_len, block_size=self.block_size,
        )
        return StepInputs(input_ids, dev("positions", num_tokens), attn, lora, dev("sample_rows", num_samples),
                          num_seqs, real_tokens, dev("sample_kv_rows", num_samples))

    def _decode_layout(self, rows: list[int], starts: list[int], samples: list[int] | list[bool],
                       token_ids: Sequence[int], pads: int, num_samples: int, all_fed: bool) -> None:
        """Writes the host sections of a step of one token a sequence (padding included): the columns packed
        straight into the buffer, and the slot mapping in a few tensor ops over them."""
        num_seqs = len(rows)
        padded = num_seqs + pads
        zeros = [0] * pads
        pack, host, at = struct.pack_into, self._host_ints, self._byte_offset
        ints = f"{padded}i"
        pack(ints, host, at["positions"], *starts, *zeros)  # padding: position 0, no context
        pack(ints, host, at["rows"], *rows, *zeros)
        if all_fed:  # the real tokens' ids are read on the device
            pack(f"{pads}i", host, at["input_ids"] + 4 * num_seqs, *zeros)
        else:
            pack(ints, host, at["input_ids"], *token_ids, *zeros)
        if self._ranges != padded:  # query offsets 0, 1, ...: written again only for another size
            pack(f"{padded + 1}i", host, at["query_start"], *range(padded + 1))
            self._ranges = padded
        if num_samples == num_seqs:  # each sequence's token is its sampled row
            pack(f"{num_seqs}i", host, at["sample_rows"], *range(num_seqs))
            pack(f"{num_seqs}i", host, at["sample_kv_rows"], *rows)
        elif num_samples:
            sampling = [i for i, s in enumerate(samples) if s]
            pack(f"{num_samples}i", host, at["sample_rows"], *sampling)
            pack(f"{num_samples}i", host, at["sample_kv_rows"], *[rows[i] for i in sampling])
        positions, rows_t = self._host_view("positions", padded), self._host_view("rows", padded)
        seq_lens = self._host_view("seq_lens", padded)
        torch.add(positions, 1, out=seq_lens)
        bs = self.block_size
        slot_mapping = self._host_view("slot_mapping", padded)
        torch.mul(self.blocks.table[rows_t, positions // bs], bs, out=slot_mapping)
        slot_mapping.add_(positions % bs)
        if pads:
            pack(f"{pads}i", host, at["seq_lens"] + 4 * num_seqs, *zeros)
            pack(f"{pads}i", host, at["slot_mapping"] + 4 * num_seqs, *[self.kv_cache.pad_slot] * pads)

    def _mixed_layout(self, rows: list[int], starts: list[int], num_new: list[int], pad_new: list[int],
                      samples: list[int] | list[bool], token_ids: Sequence[int], pads: int, real_tokens: int,
                      num_tokens: int) -> torch.Tensor:
        """Writes the host sections of a step with prompt tokens; returns each token's sequence [num_tokens]."""
        self._ranges = -1
        padded = len(rows) + pads
        zeros = [0] * pads
        per_seq = host_ints([*rows, *zeros, *starts, *zeros, *num_new, *pad_new, *samples, *zeros]).view(4, padded)
        rows_t, starts_t, qlens, samples_t = per_seq.unbind(0)  # [padded] each (views of per_seq)
        num_seqs = len(rows)
        host = self._host_view
        seq_lens = host("seq_lens", padded)
        torch.add(starts_t, qlens, out=seq_lens)
        seq_lens[num_seqs:] = 0  # padding: no context
        query_start = torch.zeros(padded + 1, dtype=torch.int64)
        torch.cumsum(qlens, 0, out=query_start[1:])
        host("query_start", padded + 1).copy_(query_start)
        arange = self._arange
        token_of = torch.repeat_interleave(arange[:padded], qlens, output_size=num_tokens)  # [num_tokens]
        positions = starts_t[token_of] + arange[:num_tokens] - query_start[token_of]
        positions[real_tokens:] = 0
        host("positions", num_tokens).copy_(positions)
        bs = self.block_size
        slot_mapping = host("slot_mapping", num_tokens)
        torch.mul(self.blocks.table[rows_t[token_of], positions // bs], bs, out=slot_mapping)
        slot_mapping.add_(positions % bs)
        slot_mapping[real_tokens:] = self.kv_cache.pad_slot
        host("rows", padded).copy_(rows_t)
        ids = host("input_ids", num_tokens)
        if real_tokens:
            ids[:real_tokens] = host_ints(token_ids, torch.int32)
        ids[real_tokens:] = 0
        sampling = samples_t.bool()
        num_samples = int(sampling.sum())
        host("sample_rows", num_samples).copy_((query_start[1:] - 1)[sampling])
        host("sample_kv_rows", num_samples).copy_(rows_t[sampling])
        return token_of

    def _host_view(self, name: str, size: int) -> torch.Tensor:
        """The first ``size`` elements of a section on the host (views made once per size: a view costs a
        step about as much as a small op)."""
        view = self._host_views.get((name, size))
        if view is None:
            view = self._host_views[name, size] = self._host[name][:size]
        return view

    def _dev_view(self, name: str, size: int) -> torch.Tensor:
        """``_host_view`` on the device."""
        view = self._dev_views.get((name, size))
        if view is None:
            view = self._dev_views[name, size] = self._dev[name][:size]
        return view

    def _stage_appends(self) -> int:
        """Stages the block-table entries appended since the last step for the device's copy; returns
        their count, 0 where the device reads the host table itself, -1 when they do not fit."""
        appended = self.blocks.take_appended()
        if self.device_table is self.blocks.table or not appended:
            return 0
        if len(appended) > self.max_appends:
            return -1
        self._host_view("appends", 3 * len(appended)).copy_(
            host_ints([v for entry in appended for v in entry], torch.int32))
        return len(appended)
