"""Which row tiling keeps a row's bits on this CPU, measured on it at start-up.

A CPU pod promises that a request's tokens do not depend on what shares its step. Each of its matmul
paths therefore runs in calls whose shapes do not depend on the step: projections in tiles of a fixed
number of rows, or in one call padded to a multiple of a few rows (``cpu_linear``), the LoRA shrink and
expand in tiles of a fixed number of rows (``kernels.cpu_lora``), attention's score and value products
over a multiple of a fixed number of query rows (``tiled_attention``). That is enough only if a row's
result depends neither on the other rows nor on its place among them, nor on how many rows or tiles one
call takes. Whether it does is the matmul library's choice, made per CPU: on a 2-core AMD EPYC 8-row
LoRA tiles kept every row's bits, and attention needed its query rows padded to a multiple of 8; on a
2-core Xeon with AMX an 8-row tile summed a rank-2 shrink ([8, 64] @ [64, 2]) differently at each place
of the tile (the shrink now computes at least ``cpu_lora.SHRINK_COLUMNS`` columns, and 8-row tiles hold
there), while attention needed no padding and a float32 projection held in one call of any multiple of
4 rows.

The native kernels sum each row in an order fixed by the row alone, so they need no tiles: attention
(``native_attention``) and LoRA (``kernels.native_lora``, one call per layer) run natively where their
kernel builds here and a check of its own (``_native_breaks``, ``_native_lora_breaks``) finds every row the
same bits alone and beside others; elsewhere the torch paths' tiles are probed. bfloat16 projections and
heads likewise take our AMX kernel (``amx_linear``: one call over any rows, each row summed on its own)
first where this CPU gives its tiles, as a candidate probed like the others.

So the pod does not trust a rule measured elsewhere: ``probe`` runs each path's own code on this machine,
in the model's shapes, over every candidate tile (the cheapest first), and keeps the first under which
every row came out the same bits alone, at each place of its tile, beside other rows and in a call of
several tiles. If no candidate holds for a path it says so (``RowRule.broken``) and keeps the largest;
the pod logs it, and ``tests/model/test_row_rule.py`` runs the same probe so that such a CPU fails in CI.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import partial

import torch

from data_plane.model import amx_linear, cpu_linear, native_attention, tiled_attention
from data_plane.model.attention import AttentionInputs
from kernels import cpu_lora, native_lora
from kernels.lora_meta import LoraMetaBuilder


@dataclass(frozen=True)
class Tiling:
    """How a projection's rows are multiplied: one call over all of them padded to a multiple of ``rows``
    (``whole``), or a call per tile of exactly ``rows`` rows, or (``ragged``) of up to ``rows`` rows, the last
    tile holding those left over unpadded."""

    rows: int
    whole: bool = False
    ragged: bool = False
    native: bool = False  # one call of our AMX kernel (``amx_linear``), which needs no padding

    def describe(self) -> str:
        if self.native:
            return "one call of the AMX kernel"
        if self.whole:
            return f"one call of a multiple of {self.rows} rows"
        return f"calls of up to {self.rows} rows" if self.ragged else f"{self.rows}-row tiles"

    def pack_settings(self) -> dict:
        """``cpu_linear.pack``'s arguments for this tiling."""
        return {"rows": self.rows, "whole": self.whole, "ragged": self.ragged, "native": self.native}


# Each path's candidates, the cheapest first. A projection's one call costs less than its tiles (a step of
# many rows makes one call, not one per tile; a decode pads fewer rows), and unpadded tiles less than padded
# ones; the tiles hold where one call does not: on a 2-core Xeon with AMX one float32 call kept every row's
# bits at every multiple of 4 rows, while in bfloat16 oneDNN summed a row differently in calls of over 32
# rows (its AMX kernels) but the same in every call of 1 to 32. Where AMX tiles are to be had, bfloat16 runs
# our own kernel (``amx_linear``), one call for any rows and each row's sums its own.
PROJECTION_TILINGS = {
    torch.float32: (Tiling(4, True), Tiling(8, True), Tiling(16, True), Tiling(16), Tiling(32)),
    torch.bfloat16: (Tiling(16, True, native=True), Tiling(32, True), Tiling(32, ragged=True), Tiling(32),
                     Tiling(64)),
    torch.float16: (Tiling(32, True), Tiling(32, ragged=True), Tiling(32), Tiling(64)),
}
LORA_ROWS = cpu_lora.ROW_TILES
ATTENTION_ROWS = tiled_attention.ROW_MULTIPLES
# LoRA ranks probed: every rank up to this (small products are where a library switches kernels by
# shape), then every eighth rank and the largest.
EVERY_RANK_UP_TO = 64


@dataclass(frozen=True)
class RowRule:
    """The tiles a CPU pod runs its matmul paths in."""

    projection: Tiling  # how every projection multiplies its rows
    head: Tiling  # how the output head does (in the weights' dtype)
    lora_rows: int  # rows of every LoRA tile
    attention_rows: int  # tiled attention: every matmul computes a multiple of this many query rows
    broken: tuple[str, ...] = ()  # paths for which no candidate held (each with what broke it)
    attention_native: bool = False  # attention by the native kernel, in place (``native_attention``)
    native_note: str = ""  # why not, where it was asked for
    lora_native: bool = False  # LoRA by the native kernel, one call per layer (``kernels.native_lora``)
    lora_note: str = ""  # why not, where it was asked for

    def describe(self) -> str:
        """One line for the pod's log and GetState."""
        if self.lora_native:
            lora = "LoRA native, per row"
        else:
            lora = f"LoRA {self.lora_rows}-row tiles" + (f" ({self.lora_note})" if self.lora_note else "")
        if self.attention_native:
            attention = "native, in place"
        else:
            attention = (f"a multiple of {self.attention_rows} query rows" if self.attention_rows > 1
                         else "query rows unpadded") + (f" ({self.native_note})" if self.native_note else "")
        text = f"projections {self.projection.describe()}, head {self.head.describe()}, {lora}, attention {attention}"
        return text + (f"; NOT INVARIANT: {'; '.join(self.broken)}" if self.broken else "")


@dataclass(frozen=True)
class LoraShape:
    """A LoRA layer as the probe needs it: its input width and its slices' output widths."""

    in_features: int
    outs: tuple[int, ...]


def probe(projections: Sequence[torch.Tensor], matmul_dtype: torch.dtype, head: torch.Tensor,
          lora: Sequence[LoraShape], max_rank: int, head_dim: int, per_kv: int, max_rows: int,
          max_head_rows: int, native_cache: torch.dtype | None = None,
          lora_dtype: torch.dtype | None = None) -> RowRule:
    """The cheapest rule under which every path keeps a row's bits on this CPU: ``projections`` (one [out,
    in] weight per shape) with operands in ``matmul_dtype`` in steps of up to ``max_rows`` rows, the output
    ``head`` [vocab, hidden] in its own dtype for up to ``max_head_rows`` rows, the LoRA layers ``lora`` at
    ranks up to ``max_rank``, attention with ``head_dim`` and ``per_kv`` query heads per key/value head: by
    the native kernel over a cache of ``native_cache`` rows where that is given and the kernel builds, takes
    the cache and keeps a query's bits (``_native_breaks``), else tiled; LoRA by the native kernel where
    ``lora_dtype`` (the layers' activations) is given and the kernel builds, takes it and keeps a row's bits
    (``_native_lora_breaks``), else in tiles. Deterministic inputs. Run it on the threads the steps compute on
    (the torch LoRA path on one, as it runs)."""
    broken: list[str] = []

    def first(path: str, candidates: Sequence, breaks: Callable, label: Callable = "{} rows".format):
        found = []
        for candidate in candidates:
            failure = breaks(candidate)
            if failure is None:
                return candidate
            found.append(f"{label(candidate)}: {failure}")
        broken.append(f"{path} ({', '.join(found)})")
        return candidates[-1]

    projection = first("projections", PROJECTION_TILINGS[matmul_dtype],
                       lambda tiling: _projection_breaks(projections, matmul_dtype, tiling, max_rows), Tiling.describe)
    head_tiling = first("output head", PROJECTION_TILINGS[head.dtype],
                        lambda tiling: _projection_breaks([head], head.dtype, tiling, max_head_rows), Tiling.describe)
    lora_note = "" if lora_dtype is None else native_lora.unusable(lora_dtype)
    if lora_dtype is not None and not lora_note:
        failure = _native_lora_breaks(lora, max_rank, lora_dtype)
        lora_note = "" if failure is None else f"the native LoRA kernel gave a row other bits: {failure}"
    lora_native, lora_rows = lora_dtype is not None and not lora_note, LORA_ROWS[0]
    if not lora_native:
        before = torch.get_num_threads()
        torch.set_num_threads(1)
        try:
            lora_rows = first("LoRA", LORA_ROWS, lambda rows: _lora_breaks(lora, max_rank, rows))
        finally:
            torch.set_num_threads(before)
    lora_rule = {"lora_native": lora_native, "lora_note": lora_note}
    note = "" if native_cache is None else native_attention.unusable(native_cache, head_dim)
    if native_cache is not None and not note:
        failure = _native_breaks(native_cache, head_dim, per_kv)
        if failure is None:
            return RowRule(projection, head_tiling, lora_rows, ATTENTION_ROWS[0], tuple(broken), True, **lora_rule)
        note = f"the native kernel gave a query other bits: {failure}"
    attention = first("attention", ATTENTION_ROWS, lambda rows: _attention_breaks(head_dim, per_kv, rows))
    return RowRule(projection, head_tiling, lora_rows, attention, tuple(broken), False, note, **lora_rule)


def _inputs(rows: int, width: int, seed: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return torch.randn(rows, width, generator=torch.Generator().manual_seed(seed)).to(dtype)


def _projection_breaks(weights: Sequence[torch.Tensor], dtype: torch.dtype, tiling: Tiling,
                       max_rows: int) -> str | None:
    """Where ``cpu_linear.linear`` under ``tiling`` gave a row other bits in steps of up to ``max_rows``
    rows, or None."""
    if tiling.native and (reason := amx_linear.unusable(dtype)):
        return reason
    for weight in weights:
        packed = cpu_linear.pack(weight, dtype, **tiling.pack_settings())
        run = partial(cpu_linear.linear, weight=weight, bias=None, packed=packed)
        rows = tiling.rows
        if tiling.whole:  # one call of each padded count: a count's kernel may differ from another's
            x = _inputs(max(3 * rows, max_rows), weight.shape[1], rows, weight.dtype)
            failure = _row_breaks(run, x[: 3 * rows], rows) or _count_breaks(run, x, rows)
        else:
            x = _inputs(3 * rows, weight.shape[1], rows, weight.dtype)
            failure = _row_breaks(run, x, rows) or (_short_tile_breaks(run, x, rows) if tiling.ragged else None)
        if failure:
            return f"[{weight.shape[0]}, {weight.shape[1]}] {failure}"
    return None


def _count_breaks(run: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor, rows: int) -> str | None:
    """Whether ``run`` gives the first rows of ``x`` other bits in a call of any count up to all of ``x``'s
    rows (each multiple of ``rows`` up to 8 of them, then each power of two, and all), or a row deep in
    the call other bits than alone."""
    n = x.shape[0]
    counts = {*range(rows, 8 * rows + 1, rows), n} | {1 << i for i in range(rows.bit_length(), n.bit_length())}
    whole = run(x)
    for count in sorted(c for c in counts if c <= n):
        if not torch.equal(run(x[:count]), whole[:count]):
            return f"a call of {count} rows gave its rows other bits than one of {n}"
    for row in sorted({n // 3 + 1, n // 2 + 3, n - 1}):
        if not torch.equal(run(x[row : row + 1]), whole[row : row + 1]):
            return f"row {row} of a call of {n} got other bits than alone"
    return None


def _short_tile_breaks(run: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor, rows: int) -> str | None:
    """Whether ``run`` gives the rows of a last tile of any count from 1 to ``rows`` (after a whole tile)
    other bits than in a whole tile."""
    whole = run(x[: 2 * rows])
    for count in range(1, rows):
        if not torch.equal(run(x[: rows + count]), whole[: rows + count]):
            return f"a last tile of {count} rows gave its rows other bits than a whole tile"
    return None


def _row_breaks(run: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor, rows: int) -> str | None:
    """Whether ``run`` (rows in, the same rows out) gives each row of ``x`` [3 * rows, in] the bits it
    gives it: in a call of several tiles, at another place of its tile, beside other rows, alone."""
    whole = run(x)
    if not torch.equal(run(x.roll(1, 0)).roll(-1, 0), whole):
        return "a row's place in its tile changed its bits"
    if not torch.equal(run(x[rows : 2 * rows]), whole[rows : 2 * rows]):
        return "the tiles of one call changed a row's bits"
    for row in (0, rows // 2 + 1, rows - 1):
        if not torch.equal(run(x[row : row + 1]), whole[row : row + 1]):
            return f"a row alone (place {row}) got other bits"
    return None


def _lora_shapes(lora: Sequence[LoraShape], max_rank: int) -> list[tuple[LoraShape, tuple[int, ...]]]:
    """(layer, ranks of its slices) to probe: each rank on the first slice alone and on every slice."""
    ranks = sorted({*range(1, min(max_rank, EVERY_RANK_UP_TO) + 1), *range(8, max_rank + 1, 8), max_rank})
    shapes = []
    for layer in set(lora):
        for r in ranks:
            shapes.append((layer, (r,) + (0,) * (len(layer.outs) - 1)))
            if len(layer.outs) > 1:
                shapes.append((layer, (r,) * len(layer.outs)))
    return shapes


def _lora_breaks(lora: Sequence[LoraShape], max_rank: int, rows: int) -> str | None:
    """Where ``cpu_lora.tile_products`` in ``rows``-row tiles gave a row other bits, or None."""
    for layer, ranks in _lora_shapes(lora, max_rank):
        slot = _slot(layer, ranks)
        x = _inputs(3 * rows, layer.in_features, sum(ranks))
        def run(t: torch.Tensor, slot: cpu_lora.PackedSlot = slot) -> torch.Tensor:
            padded = -(-t.shape[0] // rows) * rows  # a short call is padded with zero rows, as a segment is
            tiles = torch.cat([t, t.new_zeros(padded - t.shape[0], t.shape[1])]).view(-1, rows, t.shape[1])
            products = cpu_lora.tile_products(tiles, slot)
            return torch.cat([p.reshape(padded, -1) for p in products], dim=1)[: t.shape[0]]
        failure = _row_breaks(run, x, rows)
        if failure:
            return f"in {layer.in_features}, out {list(layer.outs)}, ranks {list(ranks)}: {failure}"
    return None


def _native_lora_breaks(lora: Sequence[LoraShape], max_rank: int, dtype: torch.dtype) -> str | None:
    """Where the native LoRA kernel gave a row other bits alone than in a step of three slots' runs of 70
    rows and base rows (on this thread's torch threads: a step that large may use them all), or a delta far
    from the torch path's; None where none did. Each layer at a few ranks (tails of every vector width), on
    the first slice and on each, beside the largest rank."""
    lib = native_lora.kernel()
    rows, threads = 70, torch.get_num_threads()
    for layer in set(lora):
        largest = _slot(layer, (max_rank,) * len(layer.outs))
        for r in sorted({1, 3, 17, max_rank}):
            packed = [_slot(layer, (r,) + (0,) * (len(layer.outs) - 1)), _slot(layer, (r,) * len(layer.outs)), largest]
            table = native_lora.SlotTable.empty(len(packed), len(layer.outs))
            for slot, p in enumerate(packed):
                table.set_slot(slot, p)
            x = _inputs(3 * rows + 5, layer.in_features, r, dtype)
            slots = [0] * rows + [1] * rows + [2] * rows + [-1] * 5
            width = sum(layer.outs)
            together = _native_delta(lib, table, x, slots, width, threads)
            where = f"in {layer.in_features}, out {list(layer.outs)}, rank {r}"
            for row in (0, rows // 2 + 1, rows + 3, 3 * rows - 1):
                alone = _native_delta(lib, table, x[row : row + 1], slots[row : row + 1], width, 1)
                if not torch.equal(alone, together[row : row + 1]):
                    return f"{where}: row {row} alone against a step of {len(slots)} rows"
            if together[3 * rows :].any():
                return f"{where}: a row without an adapter changed"
            picked = [0, rows + 3, 2 * rows + 5]  # a row of each slot
            expected = torch.cat([_delta(x[row : row + 1], packed[row // rows], width) for row in picked])
            if not torch.allclose(together[picked].float(), expected, rtol=1e-2, atol=1e-2 * expected.abs().max()):
                return f"{where}: deltas far from the torch path's"
    return None


def _native_delta(lib, table: native_lora.SlotTable, x: torch.Tensor, slots: list[int], width: int,
                  threads: int) -> torch.Tensor:
    """[rows, width]: the native kernel's deltas of a step of rows ``x`` of ``slots`` on ``threads`` threads."""
    y = torch.zeros(x.shape[0], width, dtype=x.dtype)
    meta = LoraMetaBuilder(len(slots), table.table.shape[0], "cpu").build(slots)
    native_lora.lora_native(lib, y, x, table, meta, threads)
    return y


def _delta(x: torch.Tensor, packed: cpu_lora.PackedSlot, width: int) -> torch.Tensor:
    """[rows, width] float32: each slice's ``(x @ A_s.T) @ B_s.T`` of ``packed`` by torch, zero elsewhere."""
    y = torch.zeros(x.shape[0], width)
    for s in packed.slices:
        y[:, s.lo : s.hi] = (x.float() @ packed.a[s.first : s.last].T) @ s.b.T
    return y


def _slot(layer: LoraShape, ranks: tuple[int, ...]) -> cpu_lora.PackedSlot:
    gen = torch.Generator().manual_seed(len(ranks) * 1000 + sum(ranks))
    offsets = [0]
    for out in layer.outs:
        offsets.append(offsets[-1] + out)
    a = [torch.randn(r, layer.in_features, generator=gen) for r in ranks]
    b = [torch.randn(out, r, generator=gen) for out, r in zip(layer.outs, ranks, strict=True)]
    return cpu_lora.packed_slot(a, b, offsets)


def _attention_breaks(head_dim: int, per_kv: int, rows: int) -> str | None:
    """Where ``tiled_attention``'s products over a multiple of ``rows`` query rows gave a query other bits:
    each query of a block of ``QUERY_BLOCK`` queries of 3 sequences and 2 key/value heads against the same
    query in calls of fewer queries, sequences and heads (a decode's one query among them), and a query
    deep in the block alone, over 1 and 3 key tiles."""
    tile, block = tiled_attention.KEY_TILE, tiled_attention.QUERY_BLOCK
    gen = torch.Generator().manual_seed(rows)
    for keys in (tile, 3 * tile):
        k, v = (torch.randn(2, 3, keys, head_dim, generator=gen) for _ in range(2))
        q = torch.randn(2, 3, block * per_kv, head_dim, generator=gen)
        whole = _attend(q, k, v, per_kv, rows, 2, 3, block)
        for heads, seqs, queries in itertools.product((1, 2), (1, 3), (1, 2, 3, 5, 8, 13, 40, block)):
            got = _attend(q, k, v, per_kv, rows, heads, seqs, queries)
            if not torch.equal(got, whole[:heads, :seqs, : queries * per_kv]):
                return (f"{keys} keys: {queries} queries of {seqs} sequences, {heads} heads got other bits than "
                        f"among {block} queries of 3 sequences, 2 heads")
        deep = block // 2 + 5
        alone = _attend(q.roll(-deep * per_kv, 2), k, v, per_kv, rows, 2, 3, 1)
        if not torch.equal(alone, whole[:, :, deep * per_kv : (deep + 1) * per_kv]):
            return f"{keys} keys: query {deep} of {block} got other bits alone"
    return None


def _attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, per_kv: int, rows: int, heads: int, seqs: int,
            queries: int) -> torch.Tensor:
    """Attention of the first ``queries`` queries of ``seqs`` sequences and ``heads`` key/value heads of ``q``
    [heads, seqs, queries * per_kv, head_dim] over all of ``k``, ``v`` [heads, seqs, keys, head_dim]."""
    hidden = torch.zeros(seqs, queries, k.shape[2], dtype=torch.bool)
    return tiled_attention._attend(q[:heads, :seqs, : queries * per_kv], k[:heads, :seqs], v[:heads, :seqs], hidden,
                                   per_kv, None, rows)


def _native_breaks(cache_dtype: torch.dtype, head_dim: int, per_kv: int) -> str | None:
    """Where the native kernel gave a query of a 100-token sequence other bits than in one chunk of all
    100: in chunks of 37 and 63, as a decode beside a prompt chunk and another decode, as a decode alone;
    over its whole context, in a window of 7 keys, and soft-capped. None where every query kept its bits."""
    kv_heads, block, length = 2, 16, 100
    gen = torch.Generator().manual_seed(head_dim)
    tables = torch.arange(3 * 8, dtype=torch.int32).flip(0).view(3, 8)  # 8 blocks each, in reverse order
    slots = 3 * 8 * block
    k_cache, v_cache = (torch.randn(slots, kv_heads, head_dim, generator=gen).to(cache_dtype) for _ in range(2))
    queries = torch.randn(3, length, kv_heads * per_kv, head_dim, generator=gen)  # each sequence's at each position
    step_kind = native_attention.NativeAttention(native_attention.kernel())

    def run(shares: list[tuple[int, int, int]], window: int | None, softcap: float | None) -> list[torch.Tensor]:
        """Each (sequence, context after the step, new tokens)'s outputs, [new, heads * head_dim]."""
        q = torch.cat([queries[b, ctx - new : ctx] for b, ctx, new in shares])
        slot = torch.cat([(tables[b].long()[torch.arange(ctx - new, ctx) // block] * block
                           + torch.arange(ctx - new, ctx) % block) for b, ctx, new in shares])
        starts = [0]
        for _, _, new in shares:
            starts.append(starts[-1] + new)
        inputs = AttentionInputs(slot, tables[[b for b, _, _ in shares]], torch.tensor([c for _, c, _ in shares]),
                                 torch.tensor(starts), max(n for _, _, n in shares), length, block)
        out = step_kind.prepare(inputs)(q, k_cache[slot], v_cache[slot], k_cache, v_cache, window, 0.125, softcap)
        return [out[starts[i] : starts[i + 1]] for i in range(len(shares))]

    for window, softcap in ((None, None), (7, None), (None, 30.0)):
        whole = run([(0, length, length)], window, softcap)[0]
        first, second = run([(0, 37, 37)], window, softcap)[0], run([(0, length, 63)], window, softcap)[0]
        if not torch.equal(torch.cat([first, second]), whole):
            return f"window {window}, softcap {softcap}: a prompt in chunks of 37 and 63 against one of {length}"
        beside = run([(1, 60, 20), (0, length, 1), (2, 33, 1)], window, softcap)[1]
        alone = run([(0, length, 1)], window, softcap)[0]
        if not torch.equal(beside, whole[-1:]) or not torch.equal(alone, whole[-1:]):
            return f"window {window}, softcap {softcap}: a decode beside others or alone, against its prompt's end"
    return None
