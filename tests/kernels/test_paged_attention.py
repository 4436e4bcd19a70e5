"""The unified Triton paged-attention kernel agrees with ``kernels.reference.paged_attention``, reads and
writes nothing else, and gives a sequence the same bits whatever shares its step.

Every run poisons what the kernel must leave alone. The KV cache starts as NaN and only the slots
of positions some query attends get values: the rest of a sequence's last block, spare blocks,
block-table entries past a sequence's blocks, and positions wholly before a sliding window (whose
blocks a pod may free) stay NaN, so reading any of them spreads NaN into the output. ``q`` is a view
into wider rows (as the q of a fused qkv projection) whose rows past ``query_start[-1]`` are NaN;
``out`` is a view into wider NaN rows, so an element left unwritten, or written outside the view or
past ``query_start[-1]``, differs from the reference. Block tables are views of wider rows and
blocks are handed out in shuffled order.

On CPU the kernel runs under Triton's interpreter (see conftest.py), whose cost grows with the
number of programs: a few heads, short contexts, and a few cases with small tiles to reach several
key tiles, query blocks and context splits (and the cap on a row's splits).
"""

from __future__ import annotations

import itertools
import math
import zlib
from dataclasses import dataclass

import pytest
import torch

from kernels import reference
from kernels.attention_launch import AttentionTiles, decode_splits
from kernels.attention_unified import AttentionWorkspace, default_tiles, unified_attention
from kernels.paged_attention import paged_attention
from tests.tolerances import RTOL, eps, magnitude, sum_atol

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
Q_PAD = 2  # rows of q and out past query_start[-1]
SPARE_BLOCKS = 2  # cache blocks no sequence owns (NaN)
PAD = (1, 0)  # a padding row of a CUDA-graph batch: one query, length 0
PAD2 = (2, 0)  # the same with two queries (a prefill item's)
SPLIT = default_tiles(64, torch.bfloat16).min_split  # a decode row longer than this is split
# Splits of 32 keys, at most 4 a row; prefill blocks of 4 tokens x 4 heads; key tiles of 16.
SMALL = AttentionTiles(block_m=16, block_n=16, decode_block_n=16, min_split=32, max_splits=4)


@dataclass
class Batch:
    """One step: ``seqs`` are (query count, length after the step) per sequence."""

    seqs: list[tuple[int, int]]
    q: torch.Tensor  # [num_tokens + Q_PAD, num_heads, head_dim], a view into wider rows
    k_cache: torch.Tensor  # [num_slots, num_kv_heads, head_dim]
    v_cache: torch.Tensor  # [num_slots, num_kv_heads, head_dim]
    block_tables: torch.Tensor  # [num_seqs, max_blocks] int32, a view into wider rows
    seq_lens: torch.Tensor  # [num_seqs] int32
    query_start: torch.Tensor  # [num_seqs + 1] int32
    block_size: int
    window: int | None
    softcap: float | None = None

    @property
    def num_tokens(self) -> int:
        return sum(qlen for qlen, _ in self.seqs)

    def kwargs(self, max_query_len: int | None = None, max_seq_len: int | None = None) -> dict:
        return dict(
            block_size=self.block_size, scale=self.q.shape[2] ** -0.5, window=self.window,
            max_query_len=max_query_len or max(qlen for qlen, _ in self.seqs),
            max_seq_len=max_seq_len or max(seq_len for _, seq_len in self.seqs), softcap=self.softcap,
        )  # fmt: skip

    def poisoned_out(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(storage, out): out is a [num_tokens + Q_PAD, num_heads, head_dim] view of NaN storage
        with wider rows."""
        rows, num_heads, head_dim = self.q.shape
        storage = torch.full((rows, num_heads * head_dim + 4), float("nan"), dtype=self.q.dtype, device=DEVICE)
        return storage, storage[:, : num_heads * head_dim].view(rows, num_heads, head_dim)


def _batch(
    seqs: list[tuple[int, int]],
    *,
    heads: tuple[int, int],  # (num_heads, num_kv_heads)
    head_dim: int,
    block_size: int,
    dtype: torch.dtype,
    window: int | None = None,
    seed: int = 0,
    softcap: float | None = None,
) -> Batch:
    gen = torch.Generator().manual_seed(seed)
    num_heads, num_kv_heads = heads
    owned = [math.ceil(seq_len / block_size) for _, seq_len in seqs]
    num_blocks = sum(owned) + SPARE_BLOCKS
    order = torch.randperm(num_blocks, generator=gen).tolist()
    spare = order[-1]  # a NaN block: what unused table entries point at
    width = max(owned) + 2
    tables = torch.full((len(seqs), width + 3), spare, dtype=torch.int32)
    shape = (num_blocks * block_size, num_kv_heads, head_dim)
    k_cache, v_cache = torch.full(shape, float("nan")), torch.full(shape, float("nan"))
    for b, ((qlen, seq_len), n) in enumerate(zip(seqs, owned, strict=True)):
        tables[b, :n] = torch.tensor(order[:n], dtype=torch.int32)
        order = order[n:]
        first_needed = 0 if window is None else max(0, seq_len - qlen - window + 1)
        pos = torch.arange(first_needed, seq_len)
        slots = tables[b, pos // block_size].long() * block_size + pos % block_size
        k_cache[slots] = torch.randn(len(pos), num_kv_heads, head_dim, generator=gen)
        v_cache[slots] = torch.randn(len(pos), num_kv_heads, head_dim, generator=gen)
    num_tokens = sum(qlen for qlen, _ in seqs)
    qkv = torch.randn(num_tokens + Q_PAD, (num_heads + 2 * num_kv_heads) * head_dim, generator=gen)
    qkv[num_tokens:] = float("nan")
    qkv = qkv.to(DEVICE, dtype)
    starts = [0]
    for qlen, _ in seqs:
        starts.append(starts[-1] + qlen)
    return Batch(
        seqs=seqs,
        q=qkv[:, : num_heads * head_dim].view(num_tokens + Q_PAD, num_heads, head_dim),
        k_cache=k_cache.to(DEVICE, dtype),
        v_cache=v_cache.to(DEVICE, dtype),
        block_tables=tables.to(DEVICE)[:, :width],
        seq_lens=torch.tensor([seq_len for _, seq_len in seqs], dtype=torch.int32, device=DEVICE),
        query_start=torch.tensor(starts, dtype=torch.int32, device=DEVICE),
        block_size=block_size,
        window=window,
        softcap=softcap,
    )


def _args(b: Batch, out: torch.Tensor) -> tuple:
    return b.q, b.k_cache, b.v_cache, b.block_tables, b.seq_lens, b.query_start, out


def _run(b: Batch, tiles: AttentionTiles | None = None, **limits):
    """The kernel's output storage: through ``paged_attention``, or through the launcher with the
    given tiles."""
    storage, out = b.poisoned_out()
    if tiles is None:
        paged_attention(*_args(b, out), **b.kwargs(**limits))
    else:
        unified_attention(*_args(b, out), **b.kwargs(**limits), tiles=tiles)
    return storage


def _tolerances(b: Batch) -> tuple[float, float]:
    """(rtol, atol) between the kernels and the reference, from the dtype and the sums' lengths.

    The scores are sums of head_dim products (+3 roundings: the scale, the max subtracted, log2 e),
    so the two sides' differ by at most ``delta`` (``sum_atol``) and their softmax weights by a
    factor within exp(±2·delta); the GPU's exp2 adds 2 ulps of float32 to each weight and to each
    split's rescaling; for fp16/bf16 the weights are rounded to that dtype before they meet the
    values (one ulp each, toward zero under the interpreter, plus fp16's subnormal spacing). Each
    of these is relative to Σ w·|v| <= max|v|. The weights' sum and the weighted values are
    L-term float32 sums, merged over at most L splits (``sum_atol``). The output is rounded once
    to its dtype (``RTOL``). Soft-capping ``c·tanh(s / c)`` moves no score further apart than it was
    (its slope is at most 1), and adds its own roundings: the kernels' tanh from a float32 sigmoid,
    within a few ulps of ``c`` (taken as 8).
    """
    dtype, num_tokens = b.q.dtype, b.num_tokens
    q_abs = b.q[:num_tokens].float().abs()  # [num_tokens, num_heads, head_dim]
    k_abs = b.k_cache.float().abs().nan_to_num(0.0)  # [num_slots, num_kv_heads, head_dim]
    score_scale = b.kwargs()["scale"] * float(torch.einsum("thd,skd->thsk", q_abs, k_abs).amax())
    delta = sum_atol(b.q.shape[2] + 3, score_scale) + (8 * eps(torch.float32) * b.softcap if b.softcap else 0.0)
    max_len = max(seq_len for _, seq_len in b.seqs)
    weights = math.expm1(2 * delta) + 8 * eps(torch.float32)
    if dtype != torch.float32:
        weights += eps(dtype) + max_len * torch.finfo(dtype).smallest_normal * eps(dtype)
    v_max = magnitude(b.v_cache)
    return RTOL[dtype], weights * v_max + sum_atol(2 * (max_len + 1), v_max)


def _check(b: Batch, storage: torch.Tensor) -> None:
    expected, out = b.poisoned_out()
    reference.paged_attention(*_args(b, out), **b.kwargs())
    assert expected[: b.num_tokens, : out[0].numel()].isfinite().all(), "the reference read poison: a test bug"
    rtol, atol = _tolerances(b)
    torch.testing.assert_close(storage, expected, rtol=rtol, atol=atol, equal_nan=True)


F16, BF16, F32 = torch.float16, torch.bfloat16, torch.float32
# (seqs as (query count, length), (heads, kv heads), head_dim, block_size, dtype, window)
CASES = {
    # Decode: one token, lengths at, before and past block boundaries.
    "decode-gqa4-bs16": ([(1, 1), (1, 15), (1, 16), (1, 17), (1, 33)], (8, 2), 64, 16, F16, None),
    "decode-gqa8-bs1-window": ([(1, 1), (1, 7), (1, 21)], (8, 1), 32, 1, BF16, 5),
    "decode-gqa1-bs12": ([(1, 11), (1, 12), (1, 13), (1, 37)], (2, 2), 16, 12, F32, None),
    "decode-padding-rows-hd128": ([(1, 11), PAD, (1, 4), PAD], (4, 1), 128, 8, BF16, None),
    # Split contexts at the default tiles (7 and 2 splits); the window's splits start past position 0.
    "decode-splits": ([(1, 5 * SPLIT + 189), (1, 2), (1, SPLIT + 1)], (2, 1), 16, 16, BF16, None),
    "decode-splits-window": ([(1, 5 * SPLIT + 189), (1, 40)], (2, 1), 16, 16, F32, 150),
    # Odd lengths: 1, 3, 7 and 133 tokens (past one split), as prompts, chunks and decodes.
    "odd-lengths-gqa4": ([(1, 1), (1, 3), (3, 3), (7, 7), (1, 133), (7, 133), (3, 7)], (8, 2), 64, 16, BF16, None),
    "odd-lengths-gqa2-window": ([(1, 133), (3, 133), (1, 7), (7, 7)], (4, 2), 32, 16, F16, 5),
    # Mixed: a fresh prompt, a chunk after a cached prefix, decodes, a one-token prompt.
    "mixed-gqa4-bs16": ([(7, 7), (5, 14), (1, 13), (1, 1), (1, 6)], (8, 2), 64, 16, BF16, None),
    "mixed-gqa8-bs8-window": ([(13, 13), (6, 26), (1, 8)], (8, 1), 32, 8, F16, 4),
    "mixed-gqa1-bs5-window-padding": ([(9, 12), PAD2, (2, 2), (1, 12), PAD], (2, 2), 32, 5, F32, 6),
    "prefill-bs32-hd128": ([(17, 17), (3, 36)], (4, 1), 128, 32, F16, None),
    "prefill-gqa3-bs3": ([(10, 10), (4, 9)], (6, 2), 16, 3, F32, None),
    "mixed-hd256": ([(3, 5), (1, 9)], (2, 1), 256, 4, BF16, None),
    # Phi-3-mini's head_dim 96: tiles of 128 columns, the last 32 masked (NaN-poisoned past each row).
    "mixed-hd96-window": ([(6, 6), (1, 20), (3, 11)], (4, 1), 96, 8, BF16, 7),
    "decode-hd48": ([(1, 9), (1, 30), PAD], (2, 2), 48, 16, F32, None),
}


@pytest.mark.parametrize("case", list(CASES))
def test_matches_reference_and_writes_only_query_rows(case):
    seqs, heads, head_dim, block_size, dtype, window = CASES[case]
    b = _batch(seqs, heads=heads, head_dim=head_dim, block_size=block_size, dtype=dtype, window=window,
               seed=zlib.crc32(case.encode()))  # fmt: skip
    _check(b, _run(b))


@pytest.mark.parametrize(("case", "softcap"), [("decode-gqa8-bs1-window", 1.5), ("mixed-gqa4-bs16", 2.0),
                                               ("odd-lengths-gqa2-window", 1.0),
                                               ("mixed-gqa1-bs5-window-padding", 0.7), ("decode-splits", 0.5)])
def test_soft_capped_scores_match_reference(case, softcap):
    # Gemma 2's attention: scores c·tanh(s / c); caps near the scores' size, so that most are bent.
    seqs, heads, head_dim, block_size, dtype, window = CASES[case]
    b = _batch(seqs, heads=heads, head_dim=head_dim, block_size=block_size, dtype=dtype, window=window,
               seed=zlib.crc32(case.encode()), softcap=softcap)  # fmt: skip
    storage = _run(b)
    _check(b, storage)
    uncapped, out = b.poisoned_out()
    reference.paged_attention(*_args(b, out), **(b.kwargs() | {"softcap": None}))
    n = b.num_tokens
    assert (storage[:n] - uncapped[:n]).abs().nan_to_num(0.0).max() > 10 * _tolerances(b)[1]


@pytest.mark.parametrize(("dtype", "window"), [(BF16, None), (F32, 40), (F16, 3)])
def test_small_tiles_walk_several_splits_query_blocks_and_key_tiles(dtype, window):
    # SMALL tiles, block size 6: rows of 1 to 4 splits, one (length 300) at the cap of 4 splits of 80 keys.
    seqs = [(1, 100), (30, 70), (1, 45), (20, 20), (1, 32), (2, 33), (1, 300), PAD]
    b = _batch(seqs, heads=(4, 1), head_dim=32, block_size=6, dtype=dtype, window=window, seed=3)
    storage = _run(b, SMALL)
    _check(b, storage)


def test_cuda_graph_sized_limits_give_the_same_bits():
    # A graph passes the largest query count and length it allows: the grid is the same (it does not
    # depend on max_seq_len) or larger, and the extra programs must exit.
    b = _batch([(4, 9), (1, 30), (1, SPLIT + 3), PAD], heads=(4, 2), head_dim=32, block_size=8, dtype=BF16, seed=5)
    exact = _run(b)
    _check(b, exact)
    assert torch.equal(_bits(_run(b, max_query_len=64, max_seq_len=32 * SPLIT + 3)), _bits(exact))


def test_one_launch_shape_serves_any_mix_of_its_token_count():
    # A CUDA graph of 24 tokens over 6 sequence rows replays one grid for every mix it is given: all
    # decodes, one chunk, chunks beside decodes, with rows of no query and tokens past the step's as
    # padding. Each matches the reference, and the sequence they share gets the same bits in each.
    shared = (1, SPLIT + 20)
    mixes = [
        [shared, (1, 7), (1, 300), (1, 1), (1, 40), (1, 2)],
        [shared, (20, 20), (0, 0), (0, 0), (0, 0), (0, 0)],
        [shared, (9, 30), (1, 5), (4, 4), (0, 0), (1, 60)],
    ]
    outputs, first = [], None
    for seqs in mixes:
        b = _batch(seqs, heads=(4, 2), head_dim=16, block_size=8, dtype=BF16, seed=29)
        first = first or b
        _copy_sequence(first, 0, b, 0)
        pad = 24 + Q_PAD - b.q.shape[0]
        b.q = torch.cat([b.q, torch.full((pad, *b.q.shape[1:]), float("nan"), dtype=BF16, device=DEVICE)])
        storage = _run(b, max_query_len=24, max_seq_len=4 * SPLIT)
        _check(b, storage)
        outputs.append(_out_rows(b, storage, 0))
    assert all(torch.equal(_bits(outputs[0]), _bits(o)) for o in outputs[1:])


def _bits(t: torch.Tensor) -> torch.Tensor:
    """The elements' bit patterns (NaN poison compares equal to itself)."""
    return t.view({2: torch.int16, 4: torch.int32}[t.element_size()])


def _rows(b: Batch, t: torch.Tensor, seq: int) -> torch.Tensor:
    """Sequence ``seq``'s rows of q or of the output storage."""
    start = sum(qlen for qlen, _ in b.seqs[:seq])
    return t[start : start + b.seqs[seq][0]]


def _out_rows(b: Batch, storage: torch.Tensor, seq: int) -> torch.Tensor:
    """Sequence ``seq``'s output: its rows of the storage, without the columns past out's rows."""
    return _rows(b, storage, seq)[:, : b.q[0].numel()]


def _copy_sequence(src: Batch, i: int, dst: Batch, j: int) -> None:
    """Gives sequence ``j`` of ``dst`` the queries, keys and values of sequence ``i`` of ``src``."""
    block = src.block_size
    slots = lambda b, s: (b.block_tables[s, :, None] * block + torch.arange(block, device=DEVICE)).flatten()
    seq_len = src.seqs[i][1]
    dst.k_cache[slots(dst, j)[:seq_len]] = src.k_cache[slots(src, i)[:seq_len]]
    dst.v_cache[slots(dst, j)[:seq_len]] = src.v_cache[slots(src, i)[:seq_len]]
    _rows(dst, dst.q, j)[:] = _rows(src, src.q, i)


def _row_output(seqs: list[tuple[int, int]], at: int, *, dtype: torch.dtype, window: int | None = None,
                tiles: AttentionTiles | None = None, **limits) -> torch.Tensor:
    """Sequence ``at``'s output in a step of ``seqs``, where it has the keys, values and queries it
    has alone (the same seed), the other sequences their own."""
    kw = dict(heads=(8, 2), head_dim=32, block_size=16, dtype=dtype, window=window, seed=11)
    b = _batch(seqs, **kw)
    _copy_sequence(_batch([seqs[at]], **kw), 0, b, at)
    storage = _run(b, tiles, **limits)
    _check(b, storage)
    return _out_rows(b, storage, at)


@pytest.mark.parametrize("dtype", [BF16, F16])
def test_decode_output_is_bit_identical_alone_and_in_a_batch(dtype):
    # The same sequence alone, then third of five next to shorter and longer ones (split in other
    # counts and sizes), with graph-sized limits.
    mine = (1, SPLIT + 77)
    alone = _row_output([mine], 0, dtype=dtype)
    batched = _row_output([(1, 3), (1, 6 * SPLIT + 5), mine, (1, 40), PAD], 2, dtype=dtype, max_seq_len=8 * SPLIT)
    assert alone.isfinite().all()
    assert torch.equal(_bits(alone), _bits(batched))


@pytest.mark.parametrize(("dtype", "window"), [(BF16, None), (F16, 40)])
def test_split_rule_gives_a_row_the_same_bits_beside_longer_and_shorter_rows(dtype, window):
    # SMALL tiles: the row's 100 keys in 4 splits of 32 (2 past a window of 40);
    # beside it rows of one split, of 2 and of the capped 4 (300 keys in splits of 80), in a
    # decode-only step and in a mixed one.
    assert decode_splits(100, None, SMALL) == (32, 4) and decode_splits(300, None, SMALL) == (80, 4)
    mine = (1, 100)
    alone = _row_output([mine], 0, dtype=dtype, window=window, tiles=SMALL)
    decode = _row_output([(1, 10), (1, 300), mine, (1, 33), (1, 64), PAD], 2, dtype=dtype, window=window,
                         tiles=SMALL)  # fmt: skip
    mixed = _row_output([(5, 37), mine, (12, 12), (1, 200), PAD2], 1, dtype=dtype, window=window, tiles=SMALL)
    assert alone.isfinite().all()
    assert torch.equal(_bits(alone), _bits(decode)) and torch.equal(_bits(alone), _bits(mixed))


def test_split_rule_follows_the_row_length_only():
    # Default tiles: splits of at least 128 keys, at most 16 a row, whatever the batch.
    tiles = default_tiles(128, BF16)
    assert decode_splits(0, None, tiles) == (64, 1)  # padding: one empty split that writes zeros
    assert decode_splits(100, None, tiles) == (128, 1)
    assert decode_splits(2048, None, tiles) == (128, 16)  # Llama-3-8B at batch 1: 128 programs
    assert decode_splits(2049, None, tiles) == (192, 11)
    assert decode_splits(1 << 20, None, tiles) == (1 << 16, 16)
    assert decode_splits(5000, 1000, tiles) == (128, 9)  # the window from 4000: keys from 3968, a tile boundary
    for seq_len in range(1, 5000, 7):
        size, count = decode_splits(seq_len, None, tiles)
        assert size % tiles.decode_block_n == 0 and 1 <= count <= tiles.max_splits
        assert (count - 1) * size < seq_len <= count * size


def test_one_workspace_serves_every_layer_of_a_step():
    # Each launch leaves its arrival counters at zero, so the next layer (or a graph's replay) can
    # reuse the workspace; rows of 7 splits and of one, a prefill chunk beside them.
    b = _batch([(1, 6 * SPLIT + 50), (3, 9), (1, 5)], heads=(4, 2), head_dim=16, block_size=16, dtype=BF16, seed=23)
    tiles = default_tiles(16, BF16)
    workspace = AttentionWorkspace.allocate(3, 4, 2, 16, tiles.max_splits, DEVICE)
    runs = []
    for _ in range(2):
        storage, out = b.poisoned_out()
        paged_attention(*_args(b, out), **b.kwargs(), workspace=workspace)
        assert not workspace.counters.any()
        runs.append(storage)
    _check(b, runs[0])
    assert torch.equal(_bits(runs[0]), _bits(runs[1]))


def test_a_sequence_gets_the_same_bits_in_a_decode_step_and_a_mixed_step():
    # Decode tokens run as decode items even in a step with prefill chunks (the first one is long
    # enough to be split, so a prefill item would round it differently), and a chunk's result does
    # not depend on the decodes beside it.
    seqs = [(1, SPLIT + 30), (6, 20), (1, 3)]
    b = _batch(seqs, heads=(8, 2), head_dim=32, block_size=8, dtype=BF16, seed=13)
    mixed = _run(b)
    _check(b, mixed)
    for keep in ([0, 2], [1]):
        sub = Batch(
            seqs=[seqs[i] for i in keep],
            q=torch.cat([_rows(b, b.q, i) for i in keep] + [b.q[-Q_PAD:]]),
            k_cache=b.k_cache, v_cache=b.v_cache,
            block_tables=b.block_tables[keep],
            seq_lens=b.seq_lens[keep],
            query_start=torch.tensor([0, *itertools.accumulate(seqs[i][0] for i in keep)], dtype=torch.int32,
                                     device=DEVICE),
            block_size=b.block_size, window=None,
        )  # fmt: skip
        alone = _run(sub)
        for j, i in enumerate(keep):
            assert torch.equal(_bits(_out_rows(sub, alone, j)), _bits(_out_rows(b, mixed, i)))


@pytest.mark.parametrize("softcap", [None, 1.5])
def test_reference_follows_its_docstring(softcap):
    # The oracle against the semantics written out query by query, in float64.
    seqs = [(3, 7), (1, 5), PAD, (4, 4)]
    b = _batch(seqs, heads=(4, 2), head_dim=16, block_size=3, dtype=F32, window=5, seed=17, softcap=softcap)
    storage, out = b.poisoned_out()
    reference.paged_attention(*_args(b, out), **b.kwargs())

    scale, t = b.kwargs()["scale"], 0
    for row, (qlen, seq_len) in enumerate(seqs):
        for i in range(qlen):
            p = seq_len - qlen + i
            js = range(max(0, p - b.window + 1), p + 1)
            slots = [int(b.block_tables[row, j // 3]) * 3 + j % 3 for j in js]
            for h in range(4):
                k, v = b.k_cache[slots, h // 2].double(), b.v_cache[slots, h // 2].double()
                s = scale * k @ b.q[t, h].double()
                s = s if softcap is None else softcap * torch.tanh(s / softcap)
                expected = torch.softmax(s, 0) @ v if slots else torch.zeros(16).double()
                torch.testing.assert_close(out[t, h].double(), expected.to(out[t, h].device), rtol=1e-5, atol=1e-6)
            t += 1
    assert storage[t:].isnan().all() and storage[:t, out[0].numel() :].isnan().all()


def test_launcher_rejects_inputs_that_do_not_match():
    b = _batch([(2, 5), (1, 3)], heads=(4, 2), head_dim=16, block_size=4, dtype=F16, seed=19)
    _, out = b.poisoned_out()
    kw = b.kwargs()
    bad = {
        "head_dim must be a multiple of 8": lambda: paged_attention(
            b.q[..., :12],
            b.k_cache[..., :12].contiguous(),
            b.v_cache[..., :12].contiguous(),
            *_args(b, out)[3:6],
            out[..., :12],
            **kw,
        ),
        "k_cache must be contiguous": lambda: paged_attention(
            b.q, b.k_cache.transpose(0, 1).contiguous().transpose(0, 1), *_args(b, out)[2:], **kw
        ),
        "k_cache must be torch.float16": lambda: paged_attention(b.q, b.k_cache.float(), *_args(b, out)[2:], **kw),
        "multiple of num_kv_heads": lambda: paged_attention(b.q[:, :3], *_args(b, out)[1:6], out[:, :3], **kw),
        "block_tables must be int32": lambda: paged_attention(
            *_args(b, out)[:3], b.block_tables.long(), *_args(b, out)[4:], **kw
        ),
        "query_start must be a contiguous int32 tensor": lambda: paged_attention(
            *_args(b, out)[:5], b.query_start[:-1], out, **kw
        ),
        "out must be": lambda: paged_attention(*_args(b, out)[:6], out.float(), **kw),
        "block_size must be a positive int dividing": lambda: paged_attention(*_args(b, out), **kw | {"block_size": 0}),
        "window must be None or a positive int": lambda: paged_attention(*_args(b, out), **kw | {"window": 0}),
        "softcap must be None or a positive number": lambda: paged_attention(*_args(b, out), **kw | {"softcap": 0.0}),
        "max_seq_len must be a host int": lambda: paged_attention(*_args(b, out), **kw | {"max_seq_len": b.seq_lens}),
        "min_split=48 must be a positive multiple": lambda: AttentionTiles(16, 16, 32, min_split=48),
        "powers of two": lambda: AttentionTiles(block_m=48, block_n=16, decode_block_n=16),
        "max_splits=0 must be at least 1": lambda: AttentionTiles(16, 16, 16, max_splits=0),
        "workspace does not fit": lambda: paged_attention(*_args(b, out), **kw, workspace=AttentionWorkspace.allocate(
            3, 4, 2, 16, default_tiles(16, F16).max_splits, DEVICE)),
    }
    for message, call in bad.items():
        with pytest.raises(ValueError, match=message):
            call()
