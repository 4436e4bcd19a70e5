"""The Triton LoRA shrink/expand kernels agree with ``kernels.reference`` and write nothing else.

Every run poisons what the kernels must leave alone: ``buf`` starts as NaN, so any element the
kernel writes but the reference does not (or the reverse) fails the comparison; rows of
base-model tokens and columns of rank-0 slices start as -0.0, which any read-add-write (even of
a zero) turns into +0.0, and must come back bit-identical; rank padding of B and ``buf`` is NaN,
so reading past an adapter's rank spreads NaN into the output. As in the layers, ``buf`` is a
view of the step metadata's larger scratch buffer (NaN outside the view, which must stay so),
and ``x`` and ``y`` are views into wider rows (the columns past ``y`` must stay -0.0).

On CPU the kernels run under Triton's interpreter (see conftest.py), whose cost grows with the
number of programs: shapes are small, and each case picks one of three tilings.
"""

from __future__ import annotations

import itertools
import random
import zlib
from dataclasses import dataclass

import pytest
import torch

from kernels import reference
from kernels.lora_expand import lora_expand
from kernels.lora_launch import Tiles
from kernels.lora_meta import LoraMeta, LoraMetaBuilder
from kernels.lora_shrink import lora_shrink
from tests.tolerances import magnitude, tolerances

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
MAX_RANK = 64
NUM_SLOTS = 5
Y_PAD = 5  # columns past y in its storage, which expand must not write
# Compared with tests.tolerances.tolerances: y is rounded once to its dtype (the interpreter rounds
# fp32 -> bf16 toward zero, the GPU to nearest), expand carries buf in two halves of the weight
# dtype, and sums run in another order than torch's.
DTYPES = (torch.float16, torch.bfloat16, torch.float32)


@dataclass(frozen=True)
class Layer:
    in_features: int
    widths: tuple[int, ...]  # output width of each slice
    ranks: tuple[tuple[int, ...], ...]  # [S][NUM_SLOTS] real rank of each slot per slice

    @property
    def offsets(self) -> list[int]:
        return [0, *itertools.accumulate(self.widths)]


# qkv-like: q wider than k and v; slot 2 does not adapt k (rank 0 there) and ranks differ by
# slice. The widths are not multiples of the tiles, so column tiles straddle slice edges.
QKV = Layer(96, (80, 24, 24), ((1, 8, 16, 64, 8), (1, 8, 0, 64, 16), (1, 8, 16, 64, 64)))
# single-slice, odd width; slot 4 is an empty slot (rank 0).
SINGLE = Layer(64, (100,), ((1, 8, 16, 64, 0),))
LAYERS = {"qkv": QKV, "single": SINGLE}

# Tile sizes passed to the launchers: "tiled" splits rank, K and columns into several tiles,
# "wide" covers each in one tile (fewest programs), "default" uses the launchers' GPU choice.
BLOCKS = {  # name: (shrink tiles, expand tiles)
    "tiled": (Tiles(m=64, n=16, k=64), Tiles(m=64, n=32, k=16)),
    "wide": (Tiles(m=128, n=64, k=128), Tiles(m=128, n=128, k=64)),
    "default": (None, None),
}


def _mix(name: str, num_tokens: int, rng: random.Random) -> list[int]:
    """Adapter slot of each token (-1 = base model) for one kind of batch."""
    slots = list(range(NUM_SLOTS))
    if name == "distinct":  # one adapter per request, as many as there are slots
        return [t % NUM_SLOTS for t in range(num_tokens)]
    if name == "uniform":
        return [rng.randrange(-1, NUM_SLOTS) for _ in range(num_tokens)]
    if name == "zipf":
        order = rng.sample([-1, *slots], NUM_SLOTS + 1)
        return rng.choices(order, weights=[1 / (i + 1) for i in range(len(order))], k=num_tokens)
    if name == "identical":
        return [3] * num_tokens
    if name == "skewed":  # one hot adapter, a long tail and some base-model traffic
        hot = rng.choice(slots)
        return [hot if rng.random() < 0.85 else rng.randrange(-1, NUM_SLOTS) for _ in range(num_tokens)]
    if name == "all_base":
        return [-1] * num_tokens
    raise ValueError(name)


MIXES = ("distinct", "uniform", "zipf", "identical", "skewed", "all_base")
TOKEN_COUNTS = (1, 3, 7, 133)


def _cases():
    """Every (token count, mix) pair once. Each token count meets every (layer, dtype) pair once,
    and each mix a different pair at each token count: coverage without the cartesian product."""
    pairs = list(itertools.product(LAYERS, DTYPES))
    for j, n in enumerate(TOKEN_COUNTS):
        for i, mix in enumerate(MIXES):
            layer, dtype = pairs[(i + j) % len(pairs)]
            blocks = list(BLOCKS)[(i + 2 * j) % len(BLOCKS)]
            case_id = f"{n}tok-{mix}-{layer}-{str(dtype).removeprefix('torch.')}-{blocks}"
            yield pytest.param(n, mix, layer, dtype, blocks, id=case_id)


CASES = list(_cases())


@dataclass
class Problem:
    layer: Layer
    token_slots: list[int]
    meta: LoraMeta  # its scratch buffer holds more tokens and slices than the problem uses
    x: torch.Tensor  # [num_tokens, in_features], a view whose rows are further apart than in_features
    lora_a: torch.Tensor  # [S, NUM_SLOTS, max_rank, in_features]
    lora_b: torch.Tensor  # [NUM_SLOTS, out_features, max_rank]
    ranks: torch.Tensor  # [S, NUM_SLOTS] int32
    slice_offsets: torch.Tensor  # [S + 1] int32

    def untouched(self) -> torch.Tensor:
        """[num_tokens, out_features + Y_PAD] bool: elements of y's storage that expand must leave alone."""
        mask = torch.ones(len(self.token_slots), self.layer.offsets[-1] + Y_PAD, dtype=torch.bool)
        for t, slot in enumerate(self.token_slots):
            for s, (lo, hi) in enumerate(itertools.pairwise(self.layer.offsets)):
                if slot >= 0 and self.layer.ranks[s][slot] > 0:
                    mask[t, lo:hi] = False
        return mask.to(DEVICE)


def _problem(
    layer: Layer, token_slots: list[int], dtype: torch.dtype, seed: int, max_rank: int = MAX_RANK
) -> Problem:
    gen = torch.Generator().manual_seed(seed)
    num_slices, out_features = len(layer.widths), layer.offsets[-1]
    x = torch.randn(len(token_slots), layer.in_features + 3, generator=gen)[:, : layer.in_features]
    # Rank padding of A stays finite: a shrink that stored columns past the rank shows against
    # the NaN-filled buf. Rank padding of B is NaN: an expand that read it shows in y.
    lora_a = torch.randn(num_slices, NUM_SLOTS, max_rank, layer.in_features, generator=gen)
    lora_a /= layer.in_features**0.5
    lora_b = torch.full((NUM_SLOTS, out_features, max_rank), float("nan"))
    for s, (lo, hi) in enumerate(itertools.pairwise(layer.offsets)):
        for slot in range(NUM_SLOTS):
            r = layer.ranks[s][slot]
            lora_b[slot, lo:hi, :r] = torch.randn(hi - lo, r, generator=gen) / max(r, 1) ** 0.5
    # As in a serving step: the metadata holds buffers for a larger step, and the layers hand the
    # kernels a [S, num_tokens, max_rank] view of its [3, max_tokens, max_rank] scratch buffer.
    builder = LoraMetaBuilder(len(token_slots) + 3, NUM_SLOTS, DEVICE, max_rank=max_rank)
    return Problem(
        layer=layer,
        token_slots=token_slots,
        meta=builder.build(token_slots),
        x=x.to(DEVICE, dtype),
        lora_a=lora_a.to(DEVICE, dtype),
        lora_b=lora_b.to(DEVICE, dtype),
        ranks=torch.tensor(layer.ranks, dtype=torch.int32, device=DEVICE),
        slice_offsets=torch.tensor(layer.offsets, dtype=torch.int32, device=DEVICE),
    )


def _poisoned_buf(p: Problem) -> torch.Tensor:
    """The step's view of the scratch buffer, all of which (view or not) is NaN."""
    p.meta.buffer.fill_(float("nan"))
    return p.meta.buffer[: len(p.layer.widths), : len(p.token_slots)]  # [S, num_tokens, max_rank]


def _reference_buf(p: Problem) -> torch.Tensor:
    """The reference shrink into the poisoned scratch view: NaN wherever expand must not read."""
    buf = _poisoned_buf(p)
    reference.lora_shrink(p.x, p.lora_a, p.ranks, p.meta, buf)
    return buf


def _poisoned_y(p: Problem, dtype: torch.dtype, seed: int) -> torch.Tensor:
    """[num_tokens, out_features + Y_PAD]: y is its first out_features columns, a view whose rows
    are further apart than their width; -0.0 wherever expand must not write (see module doc)."""
    gen = torch.Generator().manual_seed(seed + 1)
    wide = torch.randn(len(p.token_slots), p.layer.offsets[-1] + Y_PAD, generator=gen).to(DEVICE, dtype)
    wide[p.untouched()] = -0.0
    return wide


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view({2: torch.int16, 4: torch.int32}[t.element_size()])


def _assert_untouched(y: torch.Tensor, y0: torch.Tensor, mask: torch.Tensor) -> None:
    changed = (_bits(y) != _bits(y0)) & mask
    assert not changed.any(), f"expand wrote {int(changed.sum())} elements it must leave alone"


def _check_shrink(p: Problem, dtype: torch.dtype, blocks: str) -> None:
    buf = _poisoned_buf(p)

    lora_shrink(p.x, p.lora_a, p.ranks, p.meta, buf, tiles=BLOCKS[blocks][0])

    expected = torch.full_like(buf, float("nan"))
    reference.lora_shrink(p.x, p.lora_a, p.ranks, p.meta, expected)
    abs_sums = torch.full_like(buf, float("nan"))  # |x| @ |A|ᵀ: what the sums add up in absolute value
    reference.lora_shrink(p.x.abs(), p.lora_a.abs(), p.ranks, p.meta, abs_sums)
    rtol, atol = tolerances(dtype, depth=p.layer.in_features, scale=magnitude(abs_sums))
    torch.testing.assert_close(buf, expected, rtol=rtol, atol=atol, equal_nan=True)
    outside = torch.ones_like(p.meta.buffer, dtype=torch.bool)
    outside[: buf.shape[0], : buf.shape[1]] = False
    assert p.meta.buffer[outside].isnan().all(), "shrink wrote outside its view of the scratch buffer"


def _check_expand(p: Problem, dtype: torch.dtype, blocks: str, seed: int) -> None:
    buf = _reference_buf(p)
    wide0 = _poisoned_y(p, dtype, seed)
    wide, wide_ref = wide0.clone(), wide0.clone()
    out_features = p.layer.offsets[-1]

    lora_expand(wide[:, :out_features], buf, p.lora_b, p.ranks, p.slice_offsets, p.meta, tiles=BLOCKS[blocks][1])

    reference.lora_expand(wide_ref[:, :out_features], buf, p.lora_b, p.ranks, p.layer.offsets, p.meta)
    abs_sums = wide0[:, :out_features].float().abs()  # |y0| + |buf| @ |B|ᵀ
    reference.lora_expand(abs_sums, buf.abs(), p.lora_b.abs(), p.ranks, p.layer.offsets, p.meta)
    # buf is the same float32 input on both sides: the sums are the rank terms and the add to y0
    rtol, atol = tolerances(dtype, depth=p.lora_a.shape[2] + 1, scale=magnitude(abs_sums))
    torch.testing.assert_close(wide, wide_ref, rtol=rtol, atol=atol)
    _assert_untouched(wide, wide0, p.untouched())


def _case(num_tokens: int, mix: str, layer: str, dtype: torch.dtype) -> tuple[Problem, int]:
    seed = zlib.crc32(f"{num_tokens}-{mix}-{layer}".encode())
    return _problem(LAYERS[layer], _mix(mix, num_tokens, random.Random(seed)), dtype, seed), seed


@pytest.mark.parametrize(("num_tokens", "mix", "layer", "dtype", "blocks"), CASES)
def test_shrink_matches_reference_and_writes_only_real_ranks(num_tokens, mix, layer, dtype, blocks):
    p, _ = _case(num_tokens, mix, layer, dtype)
    _check_shrink(p, dtype, blocks)


@pytest.mark.parametrize(("num_tokens", "mix", "layer", "dtype", "blocks"), CASES)
def test_expand_matches_reference_and_leaves_base_rows_bit_identical(num_tokens, mix, layer, dtype, blocks):
    p, seed = _case(num_tokens, mix, layer, dtype)
    _check_expand(p, dtype, blocks, seed)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_max_rank_that_is_not_a_multiple_of_eight(dtype):
    # Padded to rank 12: expand loads rank columns in groups of gcd(12, 8) = 4 rather than 8, and
    # a 16-wide rank tile is wider than the padding.
    layer = Layer(64, (40, 24), ((12, 5, 1, 0, 3), (3, 12, 0, 7, 1)))
    token_slots = [0, 1, -1, 3, 2, 4, 1, 0, 3]
    p = _problem(layer, token_slots, dtype, seed=5, max_rank=12)
    _check_shrink(p, dtype, "tiled")
    _check_expand(p, dtype, "tiled", seed=5)


def test_slot_with_rank_zero_leaves_rows_untouched():
    # Slot 4 of SINGLE is empty; tokens 1 and 3 use it, token 2 uses a real adapter.
    token_slots = [-1, 4, 1, 4]
    p = _problem(SINGLE, token_slots, torch.float32, seed=7)
    buf = _poisoned_buf(p)
    y0 = _poisoned_y(p, torch.float32, seed=7)[:, : SINGLE.offsets[-1]]
    y = y0.clone()

    lora_shrink(p.x, p.lora_a, p.ranks, p.meta, buf, tiles=BLOCKS["wide"][0])
    lora_expand(y, buf, p.lora_b, p.ranks, p.slice_offsets, p.meta, tiles=BLOCKS["wide"][1])

    assert buf[0, [0, 1, 3]].isnan().all(), "shrink wrote rows of base or empty-slot tokens"
    assert not buf[0, 2, :8].isnan().any() and buf[0, 2, 8:].isnan().all()
    assert torch.equal(_bits(y[[0, 1, 3]]), _bits(y0[[0, 1, 3]]))
    assert not torch.equal(y[2], y0[2])


def test_shrink_then_expand_adds_the_lora_delta():
    # End to end, with ranks and slots checked against plain per-token matmuls rather than the
    # reference, so a shared misreading of the layouts would show.
    layer = QKV
    token_slots = [3, -1, 0, 2, 2, 4, 1]
    p = _problem(layer, token_slots, torch.float32, seed=11)
    buf = _poisoned_buf(p)
    y = torch.zeros(len(token_slots), layer.offsets[-1], device=DEVICE)

    lora_shrink(p.x, p.lora_a, p.ranks, p.meta, buf, tiles=BLOCKS["tiled"][0])
    lora_expand(y, buf, p.lora_b, p.ranks, p.slice_offsets, p.meta, tiles=BLOCKS["tiled"][1])

    expected, abs_sums = torch.zeros_like(y), torch.zeros_like(y)
    for t, slot in enumerate(token_slots):
        for s, (lo, hi) in enumerate(itertools.pairwise(layer.offsets)):
            r = layer.ranks[s][slot] if slot >= 0 else 0
            a, b = p.lora_a[s, slot, :r], p.lora_b[slot, lo:hi, :r]  # [r, in], [n_s, r]
            expected[t, lo:hi] = b @ (a @ p.x[t]) if r else 0.0
            abs_sums[t, lo:hi] = b.abs() @ (a.abs() @ p.x[t].abs()) if r else 0.0
    depth = layer.in_features + MAX_RANK + 1  # shrink, expand, the add to y
    rtol, atol = tolerances(torch.float32, depth=depth, scale=magnitude(abs_sums))
    torch.testing.assert_close(y, expected, rtol=rtol, atol=atol)


def test_launchers_reject_buffers_that_do_not_match():
    p = _problem(QKV, [0, 1, -1], torch.float16, seed=3)
    buf = _poisoned_buf(p)
    y = torch.zeros(3, QKV.offsets[-1], dtype=torch.float16, device=DEVICE)
    with pytest.raises(ValueError, match="buf must be float32"):
        lora_shrink(p.x, p.lora_a, p.ranks, p.meta, buf.half())
    with pytest.raises(ValueError, match="buf's rank axis must have stride 1"):
        lora_shrink(p.x, p.lora_a, p.ranks, p.meta, buf.transpose(0, 2).contiguous().transpose(0, 2))
    with pytest.raises(ValueError, match="x and lora_a must share one dtype"):
        lora_shrink(p.x.float(), p.lora_a, p.ranks, p.meta, buf)
    with pytest.raises(ValueError, match="x must have stride 1"):
        lora_shrink(p.x.t().contiguous().t(), p.lora_a, p.ranks, p.meta, buf)
    with pytest.raises(ValueError, match="ranks must be int32"):
        lora_shrink(p.x, p.lora_a, p.ranks.long(), p.meta, buf)
    with pytest.raises(ValueError, match="meta was built for 3 tokens"):
        lora_shrink(p.x[:2], p.lora_a, p.ranks, p.meta, buf[:, :2])
    with pytest.raises(ValueError, match="lora_b must be one of"):
        lora_expand(y, buf, p.lora_b.to(torch.int16), p.ranks, p.slice_offsets, p.meta)
    with pytest.raises(ValueError, match="slice_offsets must be an int32 tensor"):
        lora_expand(y, buf, p.lora_b, p.ranks, QKV.offsets, p.meta)
    with pytest.raises(ValueError, match="y must be"):
        lora_expand(y[:, :-1], buf, p.lora_b, p.ranks, p.slice_offsets, p.meta)
    with pytest.raises(ValueError, match="powers of two"):
        Tiles(m=16, n=48, k=16)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_expand_programs_walking_several_column_tiles_give_the_bits_of_one_tile_each(dtype):
    # 3 tiles of 16 columns a program over QKV's 128 columns: the last program walks past the end, and
    # tiles straddle slice edges (80 | 24 | 24); a column's sum is the same, so are its bits.
    token_slots = [0, 2, -1, 3, 4, 1, 2]
    p = _problem(QKV, token_slots, dtype, seed=13)
    buf = _reference_buf(p)
    wide0 = _poisoned_y(p, dtype, seed=13)
    out_features = QKV.offsets[-1]
    one, walked = wide0.clone(), wide0.clone()
    lora_expand(one[:, :out_features], buf, p.lora_b, p.ranks, p.slice_offsets, p.meta, tiles=Tiles(m=16, n=16, k=16))
    lora_expand(walked[:, :out_features], buf, p.lora_b, p.ranks, p.slice_offsets, p.meta,
                tiles=Tiles(m=16, n=16, k=16, col_tiles=3))
    assert torch.equal(_bits(walked), _bits(one))
    _assert_untouched(walked, wide0, p.untouched())
    assert not torch.equal(_bits(walked), _bits(wide0)), "the adapted rows must change"
