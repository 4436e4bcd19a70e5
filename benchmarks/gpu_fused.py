"""The CUDA path's fused layer ops (``kernels.fused_norm``, ``kernels.fused_rotary``,
``kernels.fused_activation``) against the torch ops they replace (``layer_ops.TorchOps``: the CPU path's
ops, which the CUDA path ran before) and against the time to read and write the bytes they touch, for one
decoder layer at decode batches and a prefill chunk. Every row is first checked against
``kernels.reference`` on the same inputs.

Timed as gpu_kernels.py times: on CUDA replayed from a CUDA graph with the L2 cache flushed; on a CPU the
kernels run under Triton's interpreter (set by gpu.py before they are imported) and their times say
nothing about speed.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from gpu_clock import Clock  # benchmarks/gpu_clock.py

from data_plane.model.config import ModelConfig
from data_plane.model.layer_ops import TorchOps
from data_plane.model.llama import RMSNorm
from data_plane.model.rope import RotaryEmbedding
from kernels import reference
from kernels.fused_activation import act_mul
from kernels.fused_norm import add_rms_norm
from kernels.fused_rotary import rotary
from tests.tolerances import RTOL, eps, magnitude, sum_atol

TORCH = TorchOps()


def _checked(got: torch.Tensor, expected: torch.Tensor, rtol: float, atol: float) -> tuple[float, bool]:
    """(largest |got - expected| beyond rtol·|expected|, whether it is within atol and nothing is NaN)."""
    excess = ((got.float() - expected.float()).abs() - rtol * expected.float().abs()).max().item()
    return excess, bool(excess <= atol) and not got.isnan().any().item()


def _row(clock: Clock, op: str, tokens: int, fused: Callable[[], object], unfused: Callable[[], object],
         moved: int, gbs: float, check: tuple[float, bool], atol: float) -> dict:
    fused_ms, how = clock.replay_ms(fused)
    torch_ms, _ = clock.replay_ms(unfused)
    floor = moved / gbs / 1e6
    return {"op": op, "tokens": tokens, "fused_ms": fused_ms, "torch_ms": torch_ms, "floor_ms": floor,
            "ratio": fused_ms / floor, "speedup": torch_ms / fused_ms, "timed": how, "max_err": check[0],
            "atol": atol, "ok": check[1]}


def norm_row(clock: Clock, config: ModelConfig, dtype: torch.dtype, tokens: int, gbs: float) -> dict:
    """The residual add and the RMSNorm after it (``add_rms_norm``), as every layer runs it twice."""
    dev, hidden = clock.device, config.hidden_size
    norm = RMSNorm(hidden, config.rms_norm_eps, config.norm_offset).to(dev, dtype)
    with torch.no_grad():
        norm.weight.copy_(1 + 0.1 * torch.randn(hidden, device=dev))
    x = torch.randn(tokens, hidden, device=dev).to(dtype)  # [tokens, hidden]
    residual = (3 * torch.randn(tokens, hidden, device=dev)).to(dtype)  # [tokens, hidden]
    expected = reference.add_rms_norm(x, residual.clone(), norm.weight, norm.eps, norm.offset)
    got = add_rms_norm(x, residual.clone(), norm.weight, norm.eps, norm.offset)
    roundings = 3 if not norm.offset else 2  # as tests/kernels/test_fused_kernels.py counts them
    atol = sum_atol(hidden + 4, magnitude(expected))
    check = _checked(got, expected, roundings * RTOL[dtype], atol)
    # x and residual read, the new residual and the output written, the weight read
    moved = x.element_size() * (4 * tokens * hidden + hidden)
    return _row(clock, "residual add + RMSNorm", tokens, lambda: add_rms_norm(x, residual, norm.weight, norm.eps,
                norm.offset), lambda: TORCH.add_norm(norm, x, residual), moved, gbs, check, atol)  # fmt: skip


def rotary_row(clock: Clock, config: ModelConfig, dtype: torch.dtype, tokens: int, gbs: float) -> dict:
    """RoPE on one layer's queries and keys, in place in the packed qkv output."""
    dev, heads, head_dim = clock.device, config.num_heads + config.num_kv_heads, config.head_dim
    rope = RotaryEmbedding(config.rope, head_dim, config.max_position_embeddings, config.rotary_dim)
    rope.build(dev)
    positions = torch.randint(0, config.max_position_embeddings, (tokens,), device=dev)  # [tokens]
    tables = rope.tables(positions, dtype)  # ([tokens, 1, rotary_dim],) * 2
    qkv = torch.randn(tokens, config.q_size + 2 * config.kv_size, device=dev).to(dtype)  # [tokens, q + k + v]
    qk = qkv[:, : heads * head_dim].view(tokens, heads, head_dim)  # [tokens, heads, head_dim], a view
    expected = reference.rotary(qk.clone(), *tables)
    got = rotary(qk.clone(), *tables)
    atol = sum_atol(3, 2 * magnitude(qk))
    check = _checked(got, expected, RTOL[dtype], atol)
    # q and k's rotary part read and written, both tables read
    moved = qk.element_size() * 2 * tokens * rope.rotary_dim * (heads + 1)
    return _row(clock, "rotary (q and k)", tokens, lambda: rotary(qk, *tables), lambda: TORCH.rotary(rope, tables, qk),
                moved, gbs, check, atol)  # fmt: skip


def act_row(clock: Clock, config: ModelConfig, dtype: torch.dtype, tokens: int, gbs: float) -> dict:
    """The gated activation on the packed gate/up output."""
    width = config.intermediate_size
    gate_up = (3 * torch.randn(tokens, 2 * width, device=clock.device)).to(dtype)  # [tokens, 2 * width]
    expected = reference.act_mul(gate_up, config.hidden_act)
    atol = 8 * eps(torch.float32) * magnitude(gate_up) ** 2
    check = _checked(act_mul(gate_up, config.hidden_act), expected, 2 * RTOL[dtype], atol)
    moved = gate_up.element_size() * 3 * tokens * width  # gate and up read, the product written
    return _row(clock, f"{config.hidden_act}(gate) x up", tokens, lambda: act_mul(gate_up, config.hidden_act),
                lambda: TORCH.act_mul(config.hidden_act, gate_up), moved, gbs, check, atol)  # fmt: skip


def fused_rows(clock: Clock, config: dict, dtype: torch.dtype, token_counts: list[int], gbs: float) -> list[dict]:
    """One row per (op, token count): checked, then the fused kernel and the torch ops timed."""
    model = ModelConfig.from_dict(config)
    return [row(clock, model, dtype, tokens, gbs) for tokens in token_counts for row in (norm_row, rotary_row,
                                                                                          act_row)]
