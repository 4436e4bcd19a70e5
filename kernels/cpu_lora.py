"""The CPU LoRA paths for steps that mix adapters: dense, gathered and segmented, beside the segment loop.

The reference path (``kernels.reference``) runs one shrink and up to S expands per adapter
segment. On a CPU each of those small matmuls costs microseconds of dispatch whatever its size,
so a decode step with several adapters can pay more for the calls than for the arithmetic. Three
paths replace the loop where they pay; all work on copies of the resident slots packed once, when
the slots change. Two cost a fixed number of ops per layer:

- dense, for a few adapters: the ranks of every resident adapter side by side,

      packed_a:  [in_features, R]   A of every (slice, slot) with a nonzero rank, transposed
      b (per slice): [R_s, width_s]  B of that slice's columns, on that slice's output rows only
      col_slots: [R]                slot that owns each packed column

  and a step is ``s = x @ packed_a``, zeroing every column that is not the token's own slot, and
  ``y[:, slice] += s[:, slice's columns] @ b`` per slice (the mask is built once per step for all
  layers of one layout). Each token is multiplied by every adapter's ranks, so the arithmetic
  grows with the number of resident adapters.
- gathered, for many adapters (the batched gather-matvec of multi-adapter serving): every slot's
  A and B zero-padded to the largest rank ``r``,

      a: [max_loras + 1, S * r, in_features]   A of each slot, slices stacked
      b: [max_loras + 1, out_features, r]      B of each slot

  and a step gathers each token's own A and B and runs two batched matrix-vector products. Index
  ``max_loras`` is all zeros: tokens without an adapter add exact zeros. The cost is moving each
  token's adapter once, whatever the number of adapters.

and one costs two ops per adapter segment, against the loop's 1 + S:

- segmented: per slot, its A of every slice side by side and its B of every slice as one
  block-diagonal matrix,

      a[slot]: [in_features, R_slot]    b[slot]: [R_slot, out_features], zero off each slice's block

  and each segment is ``y[rows] += (x[rows] @ a[slot]) @ b[slot]``, on views of its rows where the
  step has them in one run (the model runner sorts a step's sequences by slot). Each token meets only
  its own adapter's ranks, as in the loop; the expand multiplies the zero blocks too, which costs
  S times the expand's few FLOPs and spares S - 1 calls.

Which of the four is fastest depends on the CPU (its vector width, caches, memory bandwidth and
torch's per-op overhead there) as much as on the shapes, so no machine's constants decide it:
``PathTuner`` times the four on the step's own inputs, each on torch's threads and on one thread
(``CpuLoraRun``), the first time a layer plan meets a token-count and segment-count bucket, and
keeps the fastest (the way autotuners pick kernel configurations). A packed copy is built only for
layers that measure or take its path. What every layer of one step can share (the path for a plan,
the dense mask for a layout, the gather index) is kept in that step's ``CpuStepCache``.
"""

from __future__ import annotations

import contextlib
import enum
import functools
import logging
import time
from collections import OrderedDict
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, NamedTuple

import torch

if TYPE_CHECKING:
    from kernels.lora_meta import LoraMeta

log = logging.getLogger(__name__)


class CpuLoraPath(enum.Enum):
    """How a CPU step applies its adapters: the packed matmul pair, the gathered matrix-vector
    products, ``kernels.reference``'s loop over adapter segments, or a matmul pair per segment."""

    DENSE = "dense"
    GATHERED = "gathered"
    LOOP = "loop"
    SEGMENTED = "segmented"


class CpuLoraRun(NamedTuple):
    """A path and the torch threads its ops run on. A LoRA op is small: on two threads each one pays
    the threads' hand-over, which can cost more than the split saves (measured on the demo model's
    32-sequence decode step, 2-core AMD EPYC: LoRA added ~30 ms to the step with every op on two
    threads, ~18 ms with the runs the tuner chose once it also measured one)."""

    path: CpuLoraPath
    threads: int

    @property
    def label(self) -> str:
        return f"{self.path.value}/{self.threads}t"


@contextlib.contextmanager
def intra_op_threads(n: int) -> Iterator[None]:
    """torch's intra-op threads set to ``n`` for the block. With OpenMP this is the calling thread's
    count (and the default a thread that starts parallel work meanwhile takes): call it from the thread
    that runs the model."""
    before = torch.get_num_threads()
    if n == before:
        yield
        return
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)


@dataclass(frozen=True)
class SliceExpand:
    lo: int  # output rows lo:hi of this slice
    hi: int
    start: int  # its packed columns start:end
    end: int
    b: torch.Tensor  # [end - start, hi - lo] float32


@dataclass(frozen=True)
class CpuPlan:
    """A layer's shape and the real ranks of its resident adapters: what its paths' costs depend
    on. Layers with equal plans share a measured path (and a step's choice); cheap to keep per layer."""

    ranks: tuple[tuple[int, ...], ...]  # [S][max_loras] real rank of each (slice, slot)
    in_features: int
    out_features: int

    @functools.cached_property
    def rank(self) -> int:
        """R, the total rank of every resident (slot, slice): 0 when no adapter adapts the layer."""
        return sum(map(sum, self.ranks))


@dataclass(frozen=True)
class DensePack:
    packed_a: torch.Tensor  # [in_features, R] float32, columns grouped by slice, then by slot
    expands: tuple[SliceExpand, ...]  # one per slice with a nonzero rank
    col_slots: torch.Tensor  # [R] int32
    layout: tuple[tuple[int, int], ...]  # (slot, rank) of each packed group: equal layouts share a mask

    @property
    def rank(self) -> int:
        return self.col_slots.numel()


def plan(host_ranks: list[list[int]], in_features: int, out_features: int) -> CpuPlan:
    """``host_ranks``: [S][max_loras] real ranks."""
    return CpuPlan(tuple(map(tuple, host_ranks)), in_features, out_features)


def pack(lora_a: torch.Tensor, lora_b: torch.Tensor, host_ranks: list[list[int]],
         slice_offsets: list[int]) -> DensePack:
    """``lora_a``: [S, max_loras, max_rank, in]; ``lora_b``: [max_loras, out, max_rank];
    ``host_ranks``: [S][max_loras] real ranks; ``slice_offsets``: S + 1 row offsets."""
    num_slices, max_loras, _, in_features = lora_a.shape
    columns = [(s, slot, host_ranks[s][slot]) for s in range(num_slices) for slot in range(max_loras)
               if host_ranks[s][slot]]
    total = sum(r for _, _, r in columns)
    packed_a = torch.empty(in_features, total, dtype=torch.float32, device=lora_a.device)
    col_slots = torch.empty(total, dtype=torch.int32, device=lora_a.device)
    expands, c = [], 0
    for s in range(num_slices):
        lo, hi = slice_offsets[s], slice_offsets[s + 1]
        start = c
        blocks = []
        for _, slot, r in (col for col in columns if col[0] == s):
            packed_a[:, c : c + r] = lora_a[s, slot, :r].T
            blocks.append(lora_b[slot, lo:hi, :r].T.float())
            col_slots[c : c + r] = slot
            c += r
        if blocks:
            expands.append(SliceExpand(lo, hi, start, c, torch.cat(blocks).contiguous()))
    return DensePack(packed_a, tuple(expands), col_slots, tuple((slot, r) for _, slot, r in columns))


def bucket(n: int) -> int:
    """The power of two at or above ``n`` (1 for 0): steps whose token or segment counts share a
    bucket share a measured path."""
    return 1 << max(0, n - 1).bit_length()


PathKey = tuple[CpuPlan, int, int]  # a plan, its steps' token bucket and segment bucket
# A run whose first timed run is this many times the fastest one is not timed further: the noise
# between two timings of one run on a loaded machine stays well under that.
PRUNE_FACTOR = 8
# The gathered path copies each row's adapter (an all-zero one for base-model rows): where the step has
# this many rows per adapter segment it moves that many copies of each A and B for the products the
# loop computes from one, so it is not a candidate (measuring it at a 1024-token prefill alone took
# about a second on the demo model).
GATHER_MAX_TOKENS_PER_SEGMENT = 8


def candidates(num_tokens: int, num_segments: int, threads: int) -> list[CpuLoraRun]:
    """The runs worth measuring for steps of ``num_tokens`` in ``num_segments`` adapter segments (the
    tuner passes its buckets, so that every step of a bucket has had the same candidates): each path on
    ``threads`` threads and, where that is more, on one."""
    paths = list(CpuLoraPath)
    if num_tokens >= GATHER_MAX_TOKENS_PER_SEGMENT * max(1, num_segments):
        paths.remove(CpuLoraPath.GATHERED)
    return [CpuLoraRun(p, t) for p in paths for t in dict.fromkeys((threads, 1))]


class PathTuner:
    """Chooses each step's CPU path, and the threads it runs on, by measurement on this machine. The
    first time a layer plan meets a (token bucket, segment bucket), ``choose`` runs each of the
    bucket's ``candidates`` once to warm it (packs built, memory touched), then each once more timed
    with ``timer``, then those within ``PRUNE_FACTOR`` of the fastest ``repeats`` - 1 more times,
    interleaved, and keeps the run with the lowest best time (ties: the order of ``candidates``); later
    steps of that key reuse it. A new resident layout is a new plan, measured anew. ``threads`` is the
    most threads a run may take (None: torch's setting when a choice is measured). Deterministic given
    the timings."""

    def __init__(self, timer: Callable[[], float] = time.perf_counter, repeats: int = 2, capacity: int = 4096,
                 threads: int | None = None) -> None:
        if repeats < 1 or capacity < 1 or (threads is not None and threads < 1):
            raise ValueError(f"repeats, capacity and threads must be at least 1, got {repeats}, {capacity}, {threads}")
        self._timer = timer
        self._repeats = repeats
        self._capacity = capacity
        self._threads = threads
        self._chosen: OrderedDict[PathKey, CpuLoraRun] = OrderedDict()
        self.timings: dict[PathKey, dict[CpuLoraRun, float]] = {}  # the measurement behind each choice

    def choose(self, plan: CpuPlan, num_tokens: int, segments: tuple[tuple[int, int, int, int], ...],
               run: Callable[[CpuLoraRun], None]) -> CpuLoraRun:
        """The fastest run for a step of ``num_tokens`` whose adapter segments are ``segments``
        ((slot, start, end, run), as in ``LoraMeta.host_segments``); ``run(choice)`` applies the step's
        adapters by ``choice`` into scratch output, and is called only when this key is new."""
        key = (plan, bucket(num_tokens), bucket(len(segments)))
        chosen = self._chosen.get(key)
        if chosen is not None:
            self._chosen.move_to_end(key)
            return chosen
        threads = self._threads or torch.get_num_threads()
        seconds = self._measure(run, candidates(key[1], key[2], threads))
        chosen = min(seconds, key=lambda c: seconds[c])  # min keeps the first of equal times
        self._chosen[key] = chosen
        self.timings[key] = seconds
        while len(self._chosen) > self._capacity:
            self.timings.pop(self._chosen.popitem(last=False)[0], None)
        log.debug("cpu lora path measured", extra={
            "in_features": plan.in_features, "out_features": plan.out_features, "rank": plan.rank,
            "tokens_bucket": key[1], "segments_bucket": key[2], "path": chosen.label,
            **{f"{c.label}_us": round(t * 1e6, 1) for c, t in seconds.items()}})
        return chosen

    def _measure(self, run: Callable[[CpuLoraRun], None], runs: list[CpuLoraRun]) -> dict[CpuLoraRun, float]:
        for choice in runs:  # the warm run (it may build a pack): not timed
            run(choice)
        best = {}
        for choice in runs:
            started = self._timer()
            run(choice)
            best[choice] = self._timer() - started
        # A run PRUNE_FACTOR times slower than another on its first timed run cannot win, and running
        # it again costs the step most (the gathered path at a 512-token prefill: ~100 ms a layer where
        # the others take 1 ms): it keeps that time and is not run again.
        contenders = [c for c in runs if best[c] <= PRUNE_FACTOR * min(best.values())]
        for _ in range(self._repeats - 1):
            for choice in contenders:  # interleaved, so that a burst of load falls on every run
                started = self._timer()
                run(choice)
                best[choice] = min(best[choice], self._timer() - started)
        return best


# One per process: every layer runs on the same CPU.
PATH_TUNER = PathTuner()


def choose_path(plan: CpuPlan, num_tokens: int, segments: tuple[tuple[int, int, int, int], ...],
                run: Callable[[CpuLoraRun], None]) -> CpuLoraRun:
    """The run ``PATH_TUNER`` measured fastest for a step like this one (see ``PathTuner.choose``)."""
    return PATH_TUNER.choose(plan, num_tokens, segments, run)


@dataclass
class CpuStepCache:
    """What the CPU LoRA layers of one step share, computed by the first layer that needs it:
    layers with equal plans take one path, layers of one dense layout use one mask, and gathered
    layers one index. Each step has its own (``LoraMeta.step_cache``)."""

    paths: dict[CpuPlan, CpuLoraRun] = field(default_factory=dict)
    masks: dict[tuple[tuple[int, int], ...], torch.Tensor] = field(default_factory=dict)  # by DensePack.layout
    gather_indices: dict[int, torch.Tensor] = field(default_factory=dict)  # by GatherPack.zero_slot

    def mask(self, pack: DensePack, token_slots: torch.Tensor) -> torch.Tensor:
        """[num_tokens, R] bool: the packed columns of each token's own slot (``token_slots``:
        [num_tokens] int32, -1 = base model only, which owns no column)."""
        mask = self.masks.get(pack.layout)
        if mask is None:
            mask = self.masks[pack.layout] = token_slots[:, None] == pack.col_slots[None, :]
        return mask

    def gather_index(self, pack: GatherPack, token_slots: torch.Tensor) -> torch.Tensor:
        """[num_tokens] int64: each token's slot in ``pack``, its all-zero slot for tokens of slot -1."""
        index = self.gather_indices.get(pack.zero_slot)
        if index is None:
            index = torch.where(token_slots >= 0, token_slots, pack.zero_slot).long()
            self.gather_indices[pack.zero_slot] = index
        return index


def lora_dense(
    y: torch.Tensor,  # [num_tokens, out_features], updated in place
    x: torch.Tensor,  # [num_tokens, in_features]
    pack: DensePack,
    mask: torch.Tensor,  # [num_tokens, R] bool, the token's own columns (CpuStepCache.mask)
) -> None:
    """``y[t] += (x[t] @ A[slot[t]].T) @ B[slot[t]].T`` over each slice, with the semantics of
    ``kernels.reference``'s shrink then expand: accumulated in float32 and rounded once to ``y``'s
    dtype. Rows of slot -1 get exact zeros added."""
    if pack.rank == 0:
        return
    # where(), not a multiply: another adapter's product may be inf, and inf * 0 is NaN.
    s = torch.where(mask, x.float() @ pack.packed_a, 0.0)  # [num_tokens, R]
    acc = y if y.dtype == torch.float32 else y.float()
    for e in pack.expands:  # per slice: B is zero outside its slice's rows, so skip those
        acc[:, e.lo : e.hi].addmm_(s[:, e.start : e.end], e.b)
    if acc is not y:
        y.copy_(acc)


@dataclass(frozen=True)
class GatherPack:
    a: torch.Tensor  # [max_loras + 1, S * r, in_features] float32, zero past each real rank
    b: torch.Tensor  # [max_loras + 1, out_features, r] float32, zero past each real rank
    row_slice: torch.Tensor | None  # [1, out_features, 1] int64 slice of each output row (None: one slice)
    rank: int  # r

    @property
    def zero_slot(self) -> int:
        """The all-zero slot that tokens without an adapter gather."""
        return self.a.shape[0] - 1


def pack_gathered(lora_a: torch.Tensor, lora_b: torch.Tensor, host_ranks: list[list[int]],
                  slice_offsets: list[int]) -> GatherPack:
    """Arguments as for ``pack``. Only real ranks are copied: slot padding is never read."""
    num_slices, max_loras, _, in_features = lora_a.shape
    r = max(max(ranks) for ranks in host_ranks)
    a = torch.zeros(max_loras + 1, num_slices * r, in_features, dtype=torch.float32, device=lora_a.device)
    b = torch.zeros(max_loras + 1, lora_b.shape[1], r, dtype=torch.float32, device=lora_a.device)
    row_slice = None
    if num_slices > 1:
        widths = torch.tensor(slice_offsets).diff()
        row_slice = torch.repeat_interleave(torch.arange(num_slices), widths).view(1, -1, 1).to(lora_a.device)
    packed = GatherPack(a, b, row_slice, r)
    for slot in range(max_loras):
        update_gathered(packed, lora_a, lora_b, host_ranks, slice_offsets, slot)
    return packed


def update_gathered(pack: GatherPack, lora_a: torch.Tensor, lora_b: torch.Tensor, host_ranks: list[list[int]],
                    slice_offsets: list[int], slot: int) -> bool:
    """Copies ``slot`` into ``pack`` after the slot changed: 1/max_loras of a repack, which matters
    when adapters come and go. Returns False, copying nothing, when the slot's ranks exceed the
    pack's: the pack then no longer matches the slots and must be rebuilt."""
    num_slices, in_features = lora_a.shape[0], lora_a.shape[3]
    ranks = [host_ranks[s][slot] for s in range(num_slices)]
    if max(ranks) > pack.rank:
        return False
    a = pack.a.view(pack.a.shape[0], num_slices, pack.rank, in_features)
    a[slot].zero_()
    pack.b[slot].zero_()
    for s, rank in enumerate(ranks):
        lo, hi = slice_offsets[s], slice_offsets[s + 1]
        a[slot, s, :rank] = lora_a[s, slot, :rank]
        pack.b[slot, lo:hi, :rank] = lora_b[slot, lo:hi, :rank]  # rows of slice s use its rank
    return True


def lora_gathered(
    y: torch.Tensor,  # [num_tokens, out_features], updated in place
    x: torch.Tensor,  # [num_tokens, in_features]
    pack: GatherPack,
    index: torch.Tensor,  # [num_tokens] int64, each token's slot in pack (CpuStepCache.gather_index)
) -> None:
    """``y[t] += (x[t] @ A[slot[t]].T) @ B[slot[t]].T`` over each slice with the semantics of
    ``kernels.reference`` (float32, rounded once to ``y``'s dtype); rows of slot -1 get exact zeros."""
    num_tokens = x.shape[0]
    s = torch.bmm(pack.a.index_select(0, index), x.float().unsqueeze(-1))  # [T, S * r, 1]
    b = pack.b.index_select(0, index)  # [T, out, r]
    if pack.row_slice is None:
        delta = torch.bmm(b, s).squeeze(-1)  # [T, out]
    else:  # every slice's product for every row, then each row's own slice
        per_slice = torch.bmm(b, s.view(num_tokens, -1, pack.rank).transpose(1, 2))  # [T, out, S]
        delta = per_slice.gather(2, pack.row_slice.expand(num_tokens, -1, -1)).squeeze(-1)
    if y.dtype == torch.float32:
        y.add_(delta)
    else:
        y.copy_(y.float() + delta)


@dataclass(frozen=True)
class SegmentPack:
    """The segmented path's copy of a layer's slots: per slot with a rank on the layer, one A and one
    block-diagonal B, so that a segment is one matmul pair."""

    a: dict[int, torch.Tensor]  # slot -> [in_features, R_slot] float32: A of each slice, transposed, side by side
    b: dict[int, torch.Tensor]  # slot -> [R_slot, out_features] float32: B of each slice on its own rows and columns


def pack_segments(lora_a: torch.Tensor, lora_b: torch.Tensor, host_ranks: list[list[int]],
                  slice_offsets: list[int]) -> SegmentPack:
    """Arguments as for ``pack``; slots without a rank on the layer are left out. Only real ranks are
    copied: slot padding is never read."""
    num_slices, max_loras = lora_a.shape[:2]
    a, b = {}, {}
    for slot in range(max_loras):
        ranks = [host_ranks[s][slot] for s in range(num_slices)]
        if not any(ranks):
            continue
        a[slot] = torch.cat([lora_a[s, slot, :r] for s, r in enumerate(ranks) if r]).T.float().contiguous()
        b[slot] = torch.zeros(sum(ranks), lora_b.shape[1], dtype=torch.float32, device=lora_b.device)
        c = 0
        for s, r in enumerate(ranks):
            lo, hi = slice_offsets[s], slice_offsets[s + 1]
            b[slot][c : c + r, lo:hi] = lora_b[slot, lo:hi, :r].T
            c += r
    return SegmentPack(a, b)


def lora_segmented(
    y: torch.Tensor,  # [num_tokens, out_features], updated in place
    x: torch.Tensor,  # [num_tokens, in_features]
    pack: SegmentPack,
    meta: LoraMeta,
) -> None:
    """``y[t] += (x[t] @ A[slot[t]].T) @ B[slot[t]].T`` over each slice, one segment at a time, with the
    semantics of ``kernels.reference`` (float32, rounded once to ``y``'s dtype); rows of slot -1 are
    not touched. Where a token's own product overflows, its other slices' columns get NaN (inf times
    the zero blocks) where the reference leaves them finite: that row's output is lost either way. Slices
    the slot does not adapt get zeros added (a -0.0 there becomes +0.0), where the reference leaves them."""
    for slot, start, end, run in meta.host_segments:
        a = pack.a.get(slot)
        if a is None:
            continue
        rows = meta.segment_rows(start, end, run)
        if isinstance(rows, slice) and y.dtype == torch.float32:  # y[rows] is a view: add in place
            y[rows].addmm_(x[rows].float() @ a, pack.b[slot])
        else:
            y[rows] = y[rows].float().addmm_(x[rows].float() @ a, pack.b[slot]).to(y.dtype)
