"""A Llama-family decoder: Llama (1-3.x), Mistral, Qwen2, Qwen3, Phi-3, Gemma 2 and Gemma 3 share this
one module. What sets a family apart (q/k norms, Gemma's norms, scaled embeddings and soft-capping,
a second RoPE for sliding layers, partial rotary) is a field of ``ModelConfig`` that the forward reads.

q/k/v and gate/up are packed into one projection each: fewer, larger matmuls, and the LoRA
layers see them as one layer with several output slices.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from data_plane.model import cpu_linear
from data_plane.model.attention import AttentionBackend, AttentionInputs, KVCache, StepAttention
from data_plane.model.attention_backends import attention_backend
from data_plane.model.config import ModelConfig
from data_plane.model.layer_ops import LayerOps, layer_ops
from data_plane.model.precision import Precision
from data_plane.model.quantization import Fp8Matmul
from data_plane.model.rope import RotaryEmbedding
from data_plane.model.row_rule import RowRule

# A projection's way of computing ``x @ weight.T + bias`` (``Projection.matmul``).
LinearPath = Callable[[torch.Tensor, torch.Tensor, "torch.Tensor | None"], torch.Tensor]


@dataclass(frozen=True)
class ForwardBatch:
    """Everything one forward pass needs besides the weights, built once per step."""

    input_ids: torch.Tensor  # [num_tokens]
    positions: torch.Tensor  # [num_tokens]
    attn: AttentionInputs
    kv_cache: KVCache
    lora: Any = None  # per-step LoRA metadata read by LoRA-wrapped projections; None = base only
    # (cos, sin) at positions for each of the model's RoPEs (global, then Gemma 3's local); the model fills it
    rope: tuple[tuple[torch.Tensor, torch.Tensor], ...] | None = None
    attention: StepAttention | None = None  # the backend's prepared step; the model fills it
    ops: LayerOps | None = None  # the device's elementwise ops (norms, rotary, activation); the model fills it


class Projection(nn.Module):
    """``y = x @ weight.T + bias`` where ``weight`` stacks the named output ``slices``."""

    def __init__(self, in_features: int, slices: dict[str, int], bias: bool) -> None:
        super().__init__()
        self.in_features = in_features
        self.slices = dict(slices)
        self.out_features = sum(self.slices.values())
        self.weight = nn.Parameter(torch.empty(self.out_features, in_features), requires_grad=False)
        self.bias = nn.Parameter(torch.empty(self.out_features), requires_grad=False) if bias else None
        # How ``x @ weight.T + bias`` is computed, chosen once where the weights become final, never per call:
        # a plain matmul; on CPU a fixed-tile copy of the weight (``packed``, cpu_linear); where the weight is
        # FP8 (e4m3) on the device, its scales and the matmul chosen at load (``quantized``, quantization.py;
        # a CPU pod dequantizes FP8 weights at load instead).
        self.matmul: LinearPath = F.linear

    @property
    def packed(self) -> cpu_linear.CpuWeight | None:
        return self.matmul if isinstance(self.matmul, cpu_linear.CpuWeight) else None

    @packed.setter
    def packed(self, value: cpu_linear.CpuWeight | None) -> None:
        self.matmul = value or F.linear

    @property
    def quantized(self) -> Fp8Matmul | None:
        return self.matmul if isinstance(self.matmul, Fp8Matmul) else None

    @quantized.setter
    def quantized(self, value: Fp8Matmul | None) -> None:
        self.matmul = value or F.linear

    @property
    def dtype(self) -> torch.dtype:
        """The dtype of the activations it takes and returns."""
        return self.weight.dtype if self.quantized is None else self.quantized.dtype

    def slice_offsets(self) -> dict[str, tuple[int, int]]:
        """Name -> (row offset, row count) of each packed slice."""
        offsets, start = {}, 0
        for name, size in self.slices.items():
            offsets[name] = (start, size)
            start += size
        return offsets

    def forward(self, x: torch.Tensor, batch: ForwardBatch | None = None) -> torch.Tensor:
        return self.matmul(x, self.weight, self.bias)


class RMSNorm(nn.Module):
    """RMSNorm over the last dimension, scaled by ``weight`` (Llama) or by ``offset + weight`` in float32
    (Gemma's ``1 + weight``)."""

    def __init__(self, size: int, eps: float, offset: float = 0.0) -> None:
        super().__init__()
        self.eps = eps
        self.offset = offset
        self.weight = nn.Parameter(torch.empty(size), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Normalise in float32 whatever the weights' dtype, as the checkpoints were trained.
        if self.offset:  # Gemma scales in float32 and rounds once: (x * (1 + w)).to(dtype)
            return (F.rms_norm(x.float(), self.weight.shape, None, self.eps) * (self.weight.float() + self.offset)
                    ).to(x.dtype)
        if x.dtype == torch.float32:
            return F.rms_norm(x, self.weight.shape, self.weight, self.eps)
        return self.weight * F.rms_norm(x.float(), self.weight.shape, None, self.eps).to(x.dtype)


class Attention(nn.Module):
    def __init__(self, config: ModelConfig, layer: int, rotaries: list[RotaryEmbedding]) -> None:
        super().__init__()
        self.layer = layer
        self.num_heads, self.num_kv_heads, self.head_dim = config.num_heads, config.num_kv_heads, config.head_dim
        self.window = config.sliding_windows[layer]
        self.scale = config.attn_scale
        self.softcap = config.attn_softcap
        self.qkv_proj = Projection(
            config.hidden_size, {"q": config.q_size, "k": config.kv_size, "v": config.kv_size}, config.qkv_bias
        )
        self.o_proj = Projection(config.q_size, {"o": config.hidden_size}, config.o_bias)
        if config.qk_norm:
            self.q_norm = RMSNorm(config.head_dim, config.rms_norm_eps, config.norm_offset)
            self.k_norm = RMSNorm(config.head_dim, config.rms_norm_eps, config.norm_offset)
        self.qk_norm = config.qk_norm
        # Gemma 3's sliding layers turn queries and keys by their own RoPE (the model's second).
        self.rope_index = len(rotaries) - 1 if self.window is not None else 0
        self.rotary = rotaries[self.rope_index]

    def forward(self, x: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        qkv = self.qkv_proj(x, batch)
        qk, v = qkv.split([(self.num_heads + self.num_kv_heads) * self.head_dim, self.num_kv_heads * self.head_dim],
                          dim=-1)
        qk = qk.view(-1, self.num_heads + self.num_kv_heads, self.head_dim)
        if self.qk_norm:
            qk = torch.cat([self.q_norm(qk[:, : self.num_heads]), self.k_norm(qk[:, self.num_heads :])], dim=1)
        qk = batch.ops.rotary(self.rotary, batch.rope[self.rope_index], qk)
        q, k = qk[:, : self.num_heads], qk[:, self.num_heads :]
        v = v.view(-1, self.num_kv_heads, self.head_dim)
        cache = batch.kv_cache
        out = batch.attention(q, k, v, cache.k[self.layer], cache.v[self.layer], self.window, self.scale,
                              self.softcap, cache.k_scales[self.layer], cache.v_scales[self.layer])
        return self.o_proj(out, batch)


class MLP(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.activation = config.hidden_act
        self.gate_up_proj = Projection(
            config.hidden_size, {"gate": config.intermediate_size, "up": config.intermediate_size}, config.mlp_bias
        )
        self.down_proj = Projection(config.intermediate_size, {"down": config.hidden_size}, config.mlp_bias)

    def forward(self, x: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        return self.down_proj(batch.ops.act_mul(self.activation, self.gate_up_proj(x, batch)), batch)


class DecoderLayer(nn.Module):
    """Norms named as the checkpoints name them: Llama's ``post_attention_layernorm`` is the MLP's input
    norm; Gemma's (``sandwich_norms``) normalises the attention's output, ``pre_feedforward_layernorm`` the
    MLP's input and ``post_feedforward_layernorm`` its output.

    A layer takes and returns the residual stream as ``(x, residual)`` (see ``layer_ops``): the residual add
    happens in the norm after it, one fused kernel on CUDA."""

    def __init__(self, config: ModelConfig, layer: int, rotaries: list[RotaryEmbedding]) -> None:
        super().__init__()
        def norm() -> RMSNorm:
            return RMSNorm(config.hidden_size, config.rms_norm_eps, config.norm_offset)

        self.input_layernorm = norm()
        self.self_attn = Attention(config, layer, rotaries)
        self.post_attention_layernorm = norm()
        self.mlp = MLP(config)
        self.sandwich = config.sandwich_norms
        if self.sandwich:
            self.pre_feedforward_layernorm = norm()
            self.post_feedforward_layernorm = norm()

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None, batch: ForwardBatch
                ) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
        ops = batch.ops
        h, residual = ops.add_norm(self.input_layernorm, x, residual)
        if self.sandwich:
            h = ops.norm(self.post_attention_layernorm, self.self_attn(h, batch))
            h, residual = ops.add_norm(self.pre_feedforward_layernorm, h, residual)
            return ops.norm(self.post_feedforward_layernorm, self.mlp(h, batch)), residual
        h, residual = ops.add_norm(self.post_attention_layernorm, self.self_attn(h, batch), residual)
        return self.mlp(h, batch), residual


class LlamaForCausalLM(nn.Module):
    """The decoder. ``forward`` returns final hidden states; ``logits`` projects the rows
    that need a next-token distribution (usually one per sequence). ``attention`` is the backend
    of the device the weights live on (``use_device``)."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.config = config
        ropes = [config.rope] + ([config.local_rope] if config.local_rope is not None else [])
        self.rotaries = nn.ModuleList(RotaryEmbedding(rope, config.head_dim, config.max_position_embeddings,
                                                      config.rotary_dim) for rope in ropes)
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.embed_tokens.weight.requires_grad_(False)
        self.layers = nn.ModuleList(DecoderLayer(config, i, list(self.rotaries)) for i in range(config.num_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, config.norm_offset)
        if config.tie_word_embeddings:
            self.register_parameter("lm_head", None)
        else:
            self.lm_head = nn.Parameter(torch.empty(config.vocab_size, config.hidden_size), requires_grad=False)
        self._head_matmul: LinearPath = F.linear  # on CPU a fixed-tile copy of the head (``prepack_cpu_weights``)
        self.attention: AttentionBackend = attention_backend("cpu", self.windows)
        self.ops: LayerOps = layer_ops("cpu")
        self.embed_scale: float | None = None  # set by use_device, once the weights' dtype is final
        self.row_rule: RowRule | None = None  # the CPU row tiles in use, once probed (``use_row_rule``)
        self.quantization = ""  # "fp8" where the projections' weights are FP8 (set by the loader)

    def use_device(self, device: torch.device | str) -> None:
        """Builds what depends on the device the weights now live on: rotary tables, attention backend, layer
        ops."""
        for rotary in self.rotaries:
            rotary.build(device)
        rule = self.row_rule
        native = rule is None or rule.attention_native  # unprobed: the native kernel wherever it serves
        self.attention = attention_backend(device, self.windows, rule and rule.attention_rows,
                                           self.kv_cache_shape() if native else None)
        self.ops = layer_ops(device)
        scale = self.config.embed_scale  # rounded to the weights' dtype first, as Gemma does
        self.embed_scale = None if scale is None else float(torch.tensor(scale, dtype=self.embed_tokens.weight.dtype))

    @property
    def rotary(self) -> RotaryEmbedding:
        """The RoPE of the global-attention layers (every layer's but Gemma 3's sliding ones)."""
        return self.rotaries[0]

    @property
    def windows(self) -> set[int | None]:
        return set(self.config.sliding_windows)

    def forward(self, batch: ForwardBatch) -> torch.Tensor:  # [num_tokens, hidden]
        x = self.embed_tokens(batch.input_ids)
        if self.embed_scale is not None:
            x = x * self.embed_scale
        rope = batch.rope or tuple(r.tables(batch.positions, x.dtype) for r in self.rotaries)
        batch = replace(batch, rope=rope, attention=self.attention.prepare(batch.attn), ops=self.ops)
        residual = None
        for layer in self.layers:
            x, residual = layer(x, residual, batch)
        return self.ops.add_norm(self.norm, x, residual)[0]

    @property
    def head_weight(self) -> torch.Tensor:  # [vocab, hidden]
        return self.embed_tokens.weight if self.lm_head is None else self.lm_head

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:  # [rows, vocab] in float32
        logits = self._head_matmul(hidden, self.head_weight, None).float()
        cap = self.config.final_softcap
        return logits if cap is None else torch.tanh(logits / cap) * cap

    def prepack_cpu_weights(self, matmul_dtype: torch.dtype | None = None) -> None:
        """On CPU, gives every projection a fixed-tile copy of its weight taking its operands in
        ``matmul_dtype`` (default: the weights' dtype), and the output head one in the weights' dtype (its
        logits are the returned log-probabilities); see ``cpu_linear``. The tiles are ``row_rule``'s once it
        is set, else ``cpu_linear.ROW_TILES``'. Call once the weights are final."""
        if self.head_weight.device.type != "cpu":
            return
        rule = self.row_rule
        tiles = rule.projection.pack_settings() if rule else {}
        for module in self.modules():
            if isinstance(module, Projection) and module.quantized is None:
                module.packed = cpu_linear.pack(module.weight, matmul_dtype, **tiles)
        self._head_matmul = cpu_linear.pack(self.head_weight, None, **(rule.head.pack_settings() if rule else {}))

    def use_row_rule(self, rule: RowRule) -> None:
        """On CPU, runs the projections, the head and attention in ``rule``'s tiles from now on (the rule a
        pod probes at start-up, ``row_rule.probe``)."""
        if self.head_weight.device.type != "cpu":
            return
        self.row_rule = rule
        self.prepack_cpu_weights(self.precision.matmul_dtype)
        self.attention = attention_backend("cpu", self.windows, rule.attention_rows,
                                           self.kv_cache_shape() if rule.attention_native else None)

    @property
    def row_tile(self) -> int:
        """The rows every projection multiplies at once on CPU (``cpu_linear``: a step's projections cost
        the same for any row count up to it, and again for each tile past it); 0 where not tiled (on a GPU,
        or where one call takes all rows)."""
        first = next(m for m in self.modules() if isinstance(m, Projection))
        return first.packed.rows if first.packed is not None and not first.packed.whole else 0

    @property
    def precision(self) -> Precision:
        """The precision the model computes in, read from its weights and its projections' packed copies."""
        weights = self.embed_tokens.weight.dtype
        first = next(m for m in self.modules() if isinstance(m, Projection))
        return Precision.of(weights, first.packed.dtype if first.packed is not None else weights)

    # The KV cache's dtype where it is not the weights' (float8_e4m3fn under --kv-cache-dtype fp8) and each
    # layer's (k, v) scales for it (``use_kv_cache``; kv_scales.py).
    kv_dtype: torch.dtype | None = None
    kv_scales: tuple[tuple[float, ...], tuple[float, ...]] | None = None

    @property
    def precision_name(self) -> str:
        """The precision as the pod reports it (log, metric, GetState, heartbeat) and keys its prefix cache
        under: ``precision``'s value, with "+fp8" where the projections' weights are FP8 and "+kv-fp8" where
        the KV cache is."""
        name = self.precision.value + (f"+{self.quantization}" if self.quantization else "")
        return name + ("+kv-fp8" if self.kv_dtype == torch.float8_e4m3fn else "")

    def matmul_weights(self) -> list[tuple[torch.Tensor, int]]:
        """One weight of each projection shape, each with how many weights of its shape a forward
        multiplies by: the matmuls whose precision a pod chooses."""
        first = [m for m in self.layers[0].modules() if isinstance(m, Projection)]
        return [(m.weight, len(self.layers)) for m in first]

    def kv_cache_shape(self) -> tuple[torch.dtype, int]:
        """The KV cache's dtype and head dimension (what the native attention kernel must take)."""
        return self.kv_dtype or self.embed_tokens.weight.dtype, self.config.head_dim

    def use_kv_cache(self, dtype: torch.dtype, scales: tuple[tuple[float, ...], tuple[float, ...]]) -> None:
        """Keeps the KV caches made from now on in ``dtype`` (float8_e4m3fn) with each layer's (k, v) ``scales``,
        and runs attention with a backend that reads them."""
        self.kv_dtype, self.kv_scales = dtype, scales
        self.use_device(self.head_weight.device)

    def new_kv_cache(self, num_blocks: int, block_size: int) -> KVCache:
        c = self.config
        return KVCache(c.num_layers, num_blocks, block_size, c.num_kv_heads, c.head_dim, self.kv_cache_shape()[0],
                       self.embed_tokens.weight.device, self.kv_scales)
