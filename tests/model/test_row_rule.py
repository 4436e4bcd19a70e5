"""The start-up probe, run here: on this CPU, every matmul path of a CPU pod has a row tiling under which a
row's bits depend on that row alone (in the demo model's shapes and the tiny test models'), and the probe
notices a path whose rows do depend on each other. A CPU whose matmul library breaks every candidate fails
here, naming the path, the shape and what moved, instead of serving requests whose tokens depend on what
shares their step."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

from conventions.defaults import MAX_LORA_RANK
from data_plane.config import DataPlaneConfig
from data_plane.model import cpu_linear, row_rule
from kernels import cpu_lora

# (hidden, intermediate, query heads, key/value heads, head_dim, vocab, largest LoRA rank)
SHAPES = {
    "demo": (576, 1536, 9, 3, 64, 49152, MAX_LORA_RANK),  # SmolLM2-135M, the default --max-lora-rank
    "tiny": (64, 96, 4, 2, 16, 256, 32),  # tests/data_plane/conftest.py's TINY, its adapters' largest rank
}


def _probe(name: str, matmul_dtype: torch.dtype, weights_dtype: torch.dtype = torch.float32,
           native: bool = False) -> row_rule.RowRule:
    hidden, inter, heads, kv_heads, head_dim, vocab, max_rank = SHAPES[name]
    q, kv = heads * head_dim, kv_heads * head_dim
    gen = torch.Generator().manual_seed(len(name))
    def weight(out: int, inp: int) -> torch.Tensor:
        return torch.randn(out, inp, generator=gen).div_(inp**0.5).to(weights_dtype)
    projections = [weight(q + 2 * kv, hidden), weight(hidden, q), weight(2 * inter, hidden), weight(hidden, inter)]
    lora = [row_rule.LoraShape(hidden, (q, kv, kv)), row_rule.LoraShape(q, (hidden,)),
            row_rule.LoraShape(hidden, (inter, inter)), row_rule.LoraShape(inter, (hidden,))]
    return row_rule.probe(projections, matmul_dtype, weight(vocab, hidden), lora, max_rank, head_dim, heads // kv_heads,
                          POD.max_num_batched_tokens, POD.max_num_seqs, weights_dtype if native else None,
                          weights_dtype if native else None)


POD = DataPlaneConfig(model=None)  # a pod's default step sizes
PRECISIONS = {"float32": (torch.float32, torch.float32), "bfloat16-matmul": (torch.bfloat16, torch.float32),
              "bfloat16": (torch.bfloat16, torch.bfloat16)}


@pytest.mark.parametrize("native", [True, False], ids=["native-kernels", "torch-tiles"])
@pytest.mark.parametrize("precision", list(PRECISIONS))
@pytest.mark.parametrize("shapes", list(SHAPES))
def test_every_cpu_path_has_a_tiling_that_keeps_a_rows_bits_on_this_cpu(shapes, precision, native):
    matmul_dtype, weights_dtype = PRECISIONS[precision]
    if matmul_dtype == torch.bfloat16 and not cpu_linear.bfloat16_supported():
        pytest.skip("this torch's oneDNN has no bfloat16 matmul on this CPU: a pod refuses bfloat16 here")
    rule = _probe(shapes, matmul_dtype, weights_dtype, native)
    assert not rule.broken, f"on this CPU ({_cpu()}): {rule.describe()}"
    assert rule.attention_native == native, rule.describe()  # the kernel builds and keeps a query's bits here
    assert rule.lora_native == native, rule.describe()  # the LoRA kernel builds and keeps a row's bits here
    assert rule.projection in row_rule.PROJECTION_TILINGS[matmul_dtype]
    assert rule.head in row_rule.PROJECTION_TILINGS[weights_dtype]
    assert rule.lora_rows in cpu_lora.ROW_TILES


def test_the_probe_notices_a_product_whose_rows_depend_on_each_other():
    x = torch.randn(24, 16, generator=torch.Generator().manual_seed(3))
    assert row_rule._row_breaks(lambda t: t * 2, x, 8) is None
    assert row_rule._row_breaks(lambda t: t + t.sum(0), x, 8) is not None  # every row reads the others
    # a product that treats a row by its place in the call: the first row apart
    assert row_rule._row_breaks(lambda t: torch.cat([t[:1] * 3, t[1:] * 2]), x, 8) is not None


def test_the_probe_notices_a_short_last_tile_that_sums_differently():
    x = torch.randn(24, 16, generator=torch.Generator().manual_seed(4))
    def tiles(t: torch.Tensor, short: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
        return torch.cat([p * 2 if p.shape[0] == 8 else short(p) for p in t.split(8)])
    assert row_rule._short_tile_breaks(lambda t: tiles(t, lambda p: p * 2), x, 8) is None
    # a library that runs calls of fewer rows through another kernel, rounding otherwise
    failure = row_rule._short_tile_breaks(lambda t: tiles(t, lambda p: (p * 2).to(torch.bfloat16).float()), x, 8)
    assert failure is not None and "last tile of 1 rows" in failure


def test_when_no_tiling_holds_the_rule_says_so_and_keeps_the_largest(monkeypatch):
    monkeypatch.setattr(row_rule, "_attention_breaks", lambda head_dim, per_kv, rows: "a query got other bits")
    rule = _probe("tiny", torch.float32)
    assert rule.attention_rows == row_rule.ATTENTION_ROWS[-1]
    assert len(rule.broken) == 1 and rule.broken[0].startswith("attention")
    assert "NOT INVARIANT" in rule.describe()


def test_attention_stays_tiled_where_the_native_kernel_cannot_serve_and_the_rule_says_why(monkeypatch):
    monkeypatch.setattr(row_rule.native_attention, "unusable", lambda dtype, head_dim: "no compiler here")
    rule = _probe("tiny", torch.float32, native=True)
    assert not rule.attention_native and not rule.broken and rule.attention_rows in row_rule.ATTENTION_ROWS
    assert "(no compiler here)" in rule.describe()
    monkeypatch.undo()
    monkeypatch.setattr(row_rule, "_native_breaks", lambda dtype, head_dim, per_kv: "a decode moved")
    rule = _probe("tiny", torch.float32, native=True)
    assert not rule.attention_native and "the native kernel gave a query other bits: a decode moved" in rule.describe()


def test_lora_stays_in_tiles_where_the_native_kernel_cannot_serve_and_the_rule_says_why(monkeypatch):
    monkeypatch.setattr(row_rule.native_lora, "unusable", lambda dtype: "no compiler here")
    rule = _probe("tiny", torch.float32, native=True)
    assert not rule.lora_native and not rule.broken and rule.lora_rows in cpu_lora.ROW_TILES
    assert f"LoRA {rule.lora_rows}-row tiles (no compiler here)" in rule.describe()
    monkeypatch.undo()
    monkeypatch.setattr(row_rule, "_native_lora_breaks", lambda lora, max_rank, dtype: "a row moved")
    rule = _probe("tiny", torch.float32, native=True)
    assert not rule.lora_native and "the native LoRA kernel gave a row other bits: a row moved" in rule.describe()


def test_the_native_lora_check_notices_a_kernel_that_reads_other_rows(monkeypatch):
    real = row_rule.native_lora.lora_native

    def leaky(lib, y, x, slots, meta, threads):  # adds the step's first row to every row: bits depend on the step
        real(lib, y, x, slots, meta, threads)
        y += y[:1].clone()

    monkeypatch.setattr(row_rule.native_lora, "lora_native", leaky)
    failure = row_rule._native_lora_breaks([row_rule.LoraShape(64, (64, 32, 32))], 8, torch.float32)
    assert failure is not None and "alone against a step" in failure


def _cpu() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            return next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), "unknown")
    except OSError:
        return "unknown"
