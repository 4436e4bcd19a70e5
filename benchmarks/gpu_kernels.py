"""The decode step's two memory-bound kernels against the time to read the bytes they touch:
multi-adapter LoRA (shrink + expand, ``kernels.lora_shrink`` / ``kernels.lora_expand``, or the two fused
in one launch, ``kernels.lora_fused``, where the GPU's tuned table chose it) over one
decoder layer's four LoRA projections, and paged attention (``kernels.paged_attention``, one launch for
decodes and prefill chunks) over one layer's KV cache. Every row is first checked against
``kernels.reference`` on the same inputs.

On CUDA each op is replayed from a CUDA graph, as the decode step runs it; on a CPU the Triton
kernels run under Triton's interpreter (``TRITON_INTERPRET=1``, set by gpu.py before they are
imported): the same calls at tiny sizes, whose times say nothing about speed.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
from functools import partial

import torch
from gpu_clock import Clock  # benchmarks/gpu_clock.py

from kernels import reference
from kernels.attention_launch import AttentionTiles
from kernels.attention_unified import AttentionWorkspace, default_tiles, unified_attention
from kernels.lora_expand import lora_expand
from kernels.lora_fused import fused_tiles, lora_fused
from kernels.lora_meta import LoraMetaBuilder, partial_rows
from kernels.lora_shrink import lora_shrink
from tests.tolerances import RTOL, eps, magnitude, sum_atol, tolerances


def layer_projections(config: dict) -> dict[str, tuple[int, tuple[int, ...]]]:
    """The pod's LoRA projections of one decoder layer: name -> (in_features, output slice widths)."""
    hidden, inter = config["hidden_size"], config["intermediate_size"]
    q, kv = config["num_attention_heads"] * config["head_dim"], config["num_key_value_heads"] * config["head_dim"]
    return {"qkv": (hidden, (q, kv, kv)), "o": (q, (hidden,)), "gate_up": (hidden, (inter, inter)),
            "down": (inter, (hidden,))}


def _within(got: torch.Tensor, expected: torch.Tensor, rtol: float, atol: float) -> tuple[float, bool]:
    """(largest |got - expected| beyond rtol·|expected|, whether it is within atol and nothing is NaN)."""
    excess = ((got.float() - expected.float()).abs() - rtol * expected.float().abs()).max().item()
    return excess, bool(excess <= atol) and not got.isnan().any().item()


class LoraLayer:
    """One decoder layer's LoRA slot buffers (``max_loras`` slots, all of ``rank``) and a decode batch of
    ``tokens`` tokens, token t on slot t % max_loras: every token its own adapter up to ``max_loras``."""

    def __init__(self, config: dict, rank: int, tokens: int, max_loras: int, dtype: torch.dtype,
                 device: torch.device) -> None:
        self.rank, self.tokens, self.adapters = rank, tokens, min(tokens, max_loras)
        shapes = [(len(widths), in_features) for in_features, widths in layer_projections(config).values()]
        meta_builder = LoraMetaBuilder(tokens, max_loras, device, max_rank=rank, max_slices=3,
                                       partial_rows=partial_rows(shapes))  # as the pod's steps: split shrink
        self.meta = meta_builder.build([t % max_loras for t in range(tokens)])
        self.ops = []
        for in_features, widths in layer_projections(config).values():
            offsets = [0, *torch.tensor(widths).cumsum(0).tolist()]
            s, out = len(widths), offsets[-1]
            self.ops.append({
                "x": torch.randn(tokens, in_features, device=device).to(dtype),  # [tokens, in]
                "y": torch.randn(tokens, out, device=device).to(dtype),  # [tokens, out]
                # [S, max_loras, rank, in] and [max_loras, out, rank], scaled as trained adapters are
                "a": (torch.randn(s, max_loras, rank, in_features, device=device) / in_features**0.5).to(dtype),
                "b": (torch.randn(max_loras, out, rank, device=device) / rank**0.5).to(dtype),
                "ranks": torch.full((s, max_loras), rank, dtype=torch.int32, device=device),  # [S, max_loras]
                "offsets": torch.tensor(offsets, dtype=torch.int32, device=device), "host_offsets": offsets,
            })

    def run(self) -> None:
        """Every projection's LoRA into its ``y``, as the layers run it: the fused launch where this GPU's
        tuned table chose it for the shape (``kernels.lora_fused``), else shrink + expand through the
        shared scratch buffer."""
        for op in self.ops:
            tiles = fused_tiles(op["a"], op["b"])
            if tiles is not None:
                lora_fused(op["y"], op["x"], op["a"], op["b"], op["ranks"], op["offsets"], self.meta, tiles)
                continue
            buf = self.meta.buffer[: op["a"].shape[0], : self.tokens]  # [S, tokens, rank] float32
            lora_shrink(op["x"], op["a"], op["ranks"], self.meta, buf)
            lora_expand(op["y"], buf, op["b"], op["ranks"], op["offsets"], self.meta)

    def check(self) -> tuple[float, float, bool]:
        """One ``run`` against ``kernels.reference`` on the same inputs: (largest excess over rtol, the
        largest atol, all within). The atol is ``tests.tolerances.tolerances``'s bound for K = in + rank
        + 1 and the row's Σ|terms| (|y| + |B|·(|A|·|x|), computed by the reference on absolute values)."""
        start = [op["y"].clone() for op in self.ops]
        self.run()
        worst, atol_max, ok = 0.0, 0.0, True
        for op, y0 in zip(self.ops, start, strict=True):
            host_ranks = op["ranks"].tolist()
            expected, terms = y0.clone(), y0.abs()
            for y, x, a, b in ((expected, op["x"], op["a"], op["b"]), (terms, op["x"].abs(), op["a"].abs(),
                                                                         op["b"].abs())):
                buf = torch.empty(a.shape[0], self.tokens, self.rank, dtype=torch.float32, device=x.device)
                reference.lora_shrink(x, a, op["ranks"], self.meta, buf, host_ranks)
                reference.lora_expand(y, buf, b, op["ranks"], op["host_offsets"], self.meta, host_ranks)
            rtol, atol = tolerances(y0.dtype, depth=op["x"].shape[1] + self.rank + 1, scale=terms.float().max().item())
            excess, within = _within(op["y"], expected, rtol, atol)
            worst, atol_max, ok = max(worst, excess), max(atol_max, atol), ok and within
        return worst, atol_max, ok

    def bytes_touched(self) -> int:
        """x read, y read and written, A and B of the adapters in use read, the float32 scratch written and read."""
        total = 0
        for op in self.ops:
            s, _, rank, in_features = op["a"].shape
            out, e = op["y"].shape[1], op["x"].element_size()
            total += e * self.tokens * (in_features + 2 * out) + e * self.adapters * rank * (s * in_features + out)
            total += 4 * 2 * s * self.tokens * rank
        return total


def lora_rows(clock: Clock, config: dict, dtype: torch.dtype, ranks: list[int], batches: list[int],
              max_loras: int, gbs: float) -> list[dict]:
    """One row per (rank, batch): one layer's LoRA ops checked, then timed against their bytes floor."""
    rows = []
    for rank in ranks:
        for tokens in batches:
            layer = LoraLayer(config, rank, tokens, max_loras, dtype, clock.device)
            err, atol, ok = layer.check()
            ms, how = clock.replay_ms(layer.run)
            floor = layer.bytes_touched() / gbs / 1e6
            rows.append({"rank": rank, "batch": tokens, "adapters": layer.adapters, "ms": ms, "floor_ms": floor,
                         "ratio": ms / floor, "timed": how, "max_err": err, "atol": atol, "ok": ok})
    return rows


def _attention_step(config: dict, dtype: torch.dtype, seqs: list[tuple[int, int]], block_size: int,
                    dev: torch.device, rows: int) -> tuple[tuple, int]:
    """One layer's inputs for a step of ``seqs`` (query count, length after the step), blocks scattered
    over the cache, q with ``rows`` rows (those past the step's tokens: a graph bucket's padding):
    ((q, k_cache, v_cache, block_tables, seq_lens, query_start), bytes the step must move: keys and
    values read once, queries read and outputs written, block tables and lengths read)."""
    heads, kv_heads, head_dim = config["num_attention_heads"], config["num_key_value_heads"], config["head_dim"]
    per_seq = max(math.ceil(seq_len / block_size) for _, seq_len in seqs)
    num_blocks = len(seqs) * per_seq + 1
    k_cache = torch.randn(num_blocks * block_size, kv_heads, head_dim, device=dev).to(dtype)  # [slots, kv, d]
    v_cache = torch.randn(num_blocks * block_size, kv_heads, head_dim, device=dev).to(dtype)
    tables = torch.randperm(num_blocks, device=dev)[: len(seqs) * per_seq].view(len(seqs), per_seq).to(torch.int32)
    seq_lens = torch.tensor([n for _, n in seqs], dtype=torch.int32, device=dev)  # [seqs]
    starts = torch.tensor([0, *itertools.accumulate(q for q, _ in seqs)], dtype=torch.int32, device=dev)  # [seqs + 1]
    q = torch.randn(rows, heads, head_dim, device=dev).to(dtype)  # [rows, heads, head_dim]
    e = q.element_size()
    moved = sum(e * 2 * (n * kv_heads + qlen * heads) * head_dim for qlen, n in seqs) + 4 * (tables.numel() + len(seqs))
    return (q, k_cache, v_cache, tables, seq_lens, starts), moved


def tile_options(head_dim: int, dtype: torch.dtype, context: int) -> dict[str, AttentionTiles]:
    """The unified kernel's tiles a GPU run compares: ``default_tiles``; prefill items of 64 rows (fewer
    registers for the whole kernel, so two programs share an SM where the default's 128 rows allow one:
    more decode programs in flight, less reuse of each key tile in a chunk); splits of at least 256 keys
    (fewer, longer decode programs); and the fixed 512-key splits the separate decode kernel had (what
    the split rule buys at small batches)."""
    tiles = default_tiles(head_dim, dtype)
    return {"default": tiles, "64-row prefill items": dataclasses.replace(tiles, block_m=min(64, tiles.block_m)),
            "256-key splits": dataclasses.replace(tiles, min_split=256),
            "512-key splits": dataclasses.replace(tiles, min_split=512, max_splits=max(16, context // 512))}


def attention_rows(clock: Clock, config: dict, dtype: torch.dtype, batches: list[int], context: int,
                   block_size: int, gbs: float) -> list[dict]:
    """The unified paged-attention kernel (``kernels.attention_unified``) on one layer, each step checked
    against ``kernels.reference.paged_attention`` then timed against its bytes floor:

    - ``decode``: one query per sequence over ``context`` cached tokens, at each batch (the grid a
      decode-only graph launches: no prefill items);
    - ``decode, mixed grid``: the same step launched as a mixed-step graph of its token count launches it
      (``max_query_len`` = that count: the prefill items are there and exit), the cost of one graph for
      every mix;
    - ``mixed``: a prefill chunk of ``context // 4`` tokens ending at ``context`` beside the decodes of
      each batch, in one launch (the chunk's dots make it compute-bound: no target on its bytes).

    Decode and mixed steps also run with the alternatives a GPU run chooses between (``tile_options``),
    each row naming its tiles: ``default`` is ``default_tiles``."""
    rows = []
    chunk = context // 4
    head_dim = config["head_dim"]
    options = tile_options(head_dim, dtype, context)
    steps = [("decode", [(1, context)] * b, b, t) for b in batches for t in options]
    steps += [("decode, mixed grid", [(1, context)] * b, b + chunk, "default") for b in batches if b > 1]
    steps += [("mixed", [(chunk, context)] + [(1, context)] * b, b + chunk, t) for b in batches
              for t in ("default", "64-row prefill items")]  # fmt: skip
    for kind, seqs, grid_rows, label in steps:
        tiles = options[label]
        args, moved = _attention_step(config, dtype, seqs, block_size, clock.device, grid_rows)
        q, tokens = args[0], sum(n for n, _ in seqs)
        kwargs = dict(block_size=block_size, scale=q.shape[-1] ** -0.5, window=None,
                      max_query_len=max(n for n, _ in seqs) if grid_rows == tokens else grid_rows, max_seq_len=context)
        # One workspace a step, as the pod's layers share it (no memset in the timed launch).
        workspace = AttentionWorkspace.allocate(len(seqs), q.shape[1], args[1].shape[1], head_dim, tiles.max_splits,
                                                clock.device)  # fmt: skip
        out = torch.full_like(q, float("nan"))  # poisoned: every row must be written
        expected = torch.full_like(q, float("nan"))
        launch = partial(unified_attention, *args, out, **kwargs, tiles=tiles, workspace=workspace)
        launch()
        reference.paged_attention(*args, expected, **kwargs)
        atol = _attention_atol(q, args[1], args[2], kwargs["scale"], context)
        err, ok = _within(out[:tokens], expected[:tokens], RTOL[dtype], atol)
        ms, how = clock.replay_ms(launch)
        floor = moved / gbs / 1e6
        decodes = sum(1 for n, _ in seqs if n == 1)
        rows.append({"step": kind, "tiles": label, "batch": decodes, "chunk": chunk if kind == "mixed" else 0,
                     "context": context,
                     "tokens": q.shape[0], "ms": ms, "floor_ms": floor, "ratio": ms / floor, "timed": how,
                     "max_err": err, "atol": atol, "ok": ok})
    return rows


def _attention_atol(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, scale: float, context: int) -> float:
    """The kernel tests' bound (tests/kernels/test_paged_attention.py): a score is a sum of head_dim
    products (+3 roundings) that the two sides may round apart by ``delta``, moving a softmax weight by a
    factor within exp(±2·delta); the GPU's exp2 adds 2 ulps of float32 to each weight and each split's
    rescaling; fp16/bf16 weights are rounded to that dtype before they meet the values; all relative to
    max|v|; plus the L-term float32 sums of the weights and the weighted values."""
    # Σ_d |q_d|·|k_d| <= Σ_d |q_d| · max|k|: a bound on every score's Σ|terms| without the [q × k] product
    score_scale = scale * q.float().abs().sum(-1).max().item() * k_cache.float().abs().max().item()
    delta = sum_atol(q.shape[-1] + 3, score_scale)
    weights = math.expm1(2 * delta) + 8 * eps(torch.float32)
    if q.dtype != torch.float32:
        weights += eps(q.dtype) + context * torch.finfo(q.dtype).smallest_normal * eps(q.dtype)
    v_max = magnitude(v_cache)
    return weights * v_max + sum_atol(2 * (context + 1), v_max)
