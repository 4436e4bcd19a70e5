"""The model's shape, read from a Hugging Face ``config.json``."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path

from data_plane.errors import ModelLoadError

GEMMA = ("Gemma2ForCausalLM", "Gemma3ForCausalLM")
SUPPORTED_ARCHITECTURES = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM",
                           "Phi3ForCausalLM", *GEMMA, "Gemma3ForConditionalGeneration")
# Vision-language checkpoints whose text model is served (text prompts only): the architecture it is read as,
# and the fields its `text_config` may leave to transformers' defaults (the Hub's Gemma 3 configs do).
TEXT_MODELS = {"Gemma3ForConditionalGeneration": ("Gemma3ForCausalLM", dict(
    vocab_size=262_208, num_attention_heads=8, num_key_value_heads=4, head_dim=256, max_position_embeddings=131_072,
    rms_norm_eps=1e-6, query_pre_attn_scalar=256, sliding_window=4096, hidden_activation="gelu_pytorch_tanh",
    rope_theta=1_000_000.0, rope_local_base_freq=10_000.0, tie_word_embeddings=True))}
SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3", "longrope")
SUPPORTED_ACTIVATIONS = ("silu", "gelu_pytorch_tanh")
# Layers per sliding/global cycle of Gemma configs written before `layer_types` existed (the last
# layer of each cycle attends globally).
_GEMMA_PATTERN = {"Gemma2ForCausalLM": 2, "Gemma3ForCausalLM": 6}


@dataclass(frozen=True)
class RopeConfig:
    theta: float = 10000.0
    rope_type: str = "default"
    factor: float = 1.0
    # llama3 scaling only.
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192
    # longrope (Phi-3.5, Phi-4-mini): per-frequency divisors within the original context, and the factor
    # cos and sin are scaled by. The long factors are not used: see _max_positions.
    short_factor: tuple[float, ...] | None = None
    attention_factor: float = 1.0


@dataclass(frozen=True)
class ModelConfig:
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    qkv_bias: bool
    o_bias: bool
    mlp_bias: bool
    rope: RopeConfig
    # Per layer: None for full attention, else the window in tokens.
    sliding_windows: tuple[int | None, ...]
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = field(default_factory=tuple)
    # What sets the families apart, read by the one forward (defaults: Llama).
    qk_norm: bool = False  # Qwen3, Gemma 3: RMSNorm over each head's query and key before RoPE
    norm_offset: float = 0.0  # Gemma: norms scale by (offset + weight), in float32
    sandwich_norms: bool = False  # Gemma: norms on the attention's and the MLP's outputs too
    hidden_act: str = "silu"
    embed_scale: float | None = None  # Gemma: embeddings times sqrt(hidden_size), rounded to the dtype
    query_pre_attn_scalar: float | None = None  # Gemma: attention scale is its -1/2 power (else head_dim's)
    attn_softcap: float | None = None  # Gemma 2: scores = cap * tanh(scores / cap)
    final_softcap: float | None = None  # Gemma 2: logits = cap * tanh(logits / cap)
    local_rope: RopeConfig | None = None  # Gemma 3: the sliding layers' own RoPE
    rotary_dim: int | None = None  # Phi: RoPE on the first rotary_dim of each head (None: all of it)

    def __post_init__(self) -> None:
        if self.architecture not in SUPPORTED_ARCHITECTURES:
            raise ModelLoadError(
                f"unsupported architecture {self.architecture!r}; lorafleet serves "
                f"{', '.join(SUPPORTED_ARCHITECTURES)}"
            )
        if self.num_heads % self.num_kv_heads:
            raise ModelLoadError(
                f"num_attention_heads ({self.num_heads}) must be a multiple of "
                f"num_key_value_heads ({self.num_kv_heads})"
            )
        if self.rope.rope_type not in SUPPORTED_ROPE_TYPES:
            raise ModelLoadError(
                f"unsupported rope scaling {self.rope.rope_type!r}; supported: {', '.join(SUPPORTED_ROPE_TYPES)}"
            )
        if len(self.sliding_windows) != self.num_layers:
            raise ModelLoadError("layer_types must name one attention type per layer")
        if self.hidden_act not in SUPPORTED_ACTIVATIONS:
            raise ModelLoadError(
                f"unsupported activation {self.hidden_act!r}; supported: {', '.join(SUPPORTED_ACTIVATIONS)}"
            )
        if self.local_rope is not None and self.local_rope.rope_type not in SUPPORTED_ROPE_TYPES:
            raise ModelLoadError(f"unsupported rope scaling {self.local_rope.rope_type!r} for the sliding layers; "
                                 f"supported: {', '.join(SUPPORTED_ROPE_TYPES)}")
        rotary = self.rotary_dim if self.rotary_dim is not None else self.head_dim
        if rotary % 2 or not 0 < rotary <= self.head_dim:
            raise ModelLoadError(f"partial_rotary_factor gives {rotary} rotary dimensions of a head of "
                                 f"{self.head_dim}; it must give an even number from 2 to head_dim")
        if self.rope.short_factor is not None and len(self.rope.short_factor) != rotary // 2:
            raise ModelLoadError(f"longrope short_factor has {len(self.rope.short_factor)} entries, but the "
                                 f"{rotary} rotary dimensions need {rotary // 2}")

    @property
    def attn_scale(self) -> float:
        """What query·key products are multiplied by before the softmax."""
        return (self.query_pre_attn_scalar or self.head_dim) ** -0.5

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    @classmethod
    def from_dict(cls, raw: dict) -> ModelConfig:
        architectures = raw.get("architectures") or []
        if len(architectures) != 1:
            raise ModelLoadError(
                f"config.json must name exactly one architecture, found {architectures!r}"
            )
        arch = architectures[0]
        if arch in TEXT_MODELS:
            arch, defaults = TEXT_MODELS[arch]
            top = {k: raw[k] for k in ("bos_token_id", "eos_token_id", "tie_word_embeddings") if k in raw}
            raw = defaults | dict(raw.get("text_config") or {}) | top
        try:
            hidden = int(raw["hidden_size"])
            heads = int(raw["num_attention_heads"])
            layers = int(raw["num_hidden_layers"])
            kv_heads = int(raw.get("num_key_value_heads") or heads)
            head_dim = int(raw.get("head_dim") or hidden // heads)
            gemma = arch in GEMMA
            rope, local_rope = _ropes_from_dict(raw, arch)
            return cls(
                architecture=arch,
                vocab_size=int(raw["vocab_size"]),
                hidden_size=hidden,
                intermediate_size=int(raw["intermediate_size"]),
                num_layers=layers,
                num_heads=heads,
                num_kv_heads=kv_heads,
                head_dim=head_dim,
                rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
                max_position_embeddings=_max_positions(raw, rope),
                tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
                qkv_bias=arch == "Qwen2ForCausalLM" or bool(raw.get("attention_bias", False)),
                o_bias=arch != "Qwen2ForCausalLM" and bool(raw.get("attention_bias", False)),
                mlp_bias=bool(raw.get("mlp_bias", False)),
                rope=rope,
                sliding_windows=_sliding_windows(raw, arch, layers),
                bos_token_id=raw.get("bos_token_id"),
                eos_token_ids=_as_tuple(raw.get("eos_token_id")),
                qk_norm=arch in ("Qwen3ForCausalLM", "Gemma3ForCausalLM"),
                norm_offset=1.0 if gemma else 0.0,
                sandwich_norms=gemma,
                hidden_act=str(raw.get("hidden_activation") or raw.get("hidden_act") or "silu"),
                embed_scale=hidden**0.5 if gemma else None,
                query_pre_attn_scalar=_optional_float(raw.get("query_pre_attn_scalar")) if gemma else None,
                attn_softcap=_optional_float(raw.get("attn_logit_softcapping")),
                final_softcap=_optional_float(raw.get("final_logit_softcapping")),
                local_rope=local_rope,
                rotary_dim=_rotary_dim(raw, head_dim),
            )
        except KeyError as e:
            raise ModelLoadError(f"config.json lacks the required field {e.args[0]!r}") from None
        except (TypeError, ValueError) as e:
            raise ModelLoadError(f"config.json has a malformed field: {e}") from None

    @classmethod
    def from_dir(cls, model_dir: str | Path) -> ModelConfig:
        path = Path(model_dir) / "config.json"
        if not path.is_file():
            raise ModelLoadError(f"{path} not found: a model directory needs config.json")
        try:
            raw = json.loads(path.read_text())
        except json.JSONDecodeError as e:
            raise ModelLoadError(f"{path} is not valid JSON: {e}") from None
        return cls.from_dict(raw)


def _as_tuple(value) -> tuple[int, ...]:
    if value is None:
        return ()
    if isinstance(value, list):
        return tuple(int(v) for v in value)
    return (int(value),)


def _max_positions(raw: dict, rope: RopeConfig) -> int:
    """The context served. With longrope, transformers turns every position to the long factors once a
    sequence passes the original context, those already cached included; a paged cache cannot follow
    that, so the context stops at the original one, where the short factors hold for every token."""
    positions = int(raw.get("max_position_embeddings", 2048))
    if rope.rope_type == "longrope":
        return min(positions, rope.original_max_position_embeddings)
    return positions


def _optional_float(value) -> float | None:
    return None if value is None else float(value)


def _rotary_dim(raw: dict, head_dim: int) -> int | None:
    factor = (raw.get("rope_parameters") or {}).get("partial_rotary_factor", raw.get("partial_rotary_factor"))
    return None if factor is None or float(factor) == 1.0 else int(head_dim * float(factor))


def _ropes_from_dict(raw: dict, arch: str) -> tuple[RopeConfig, RopeConfig | None]:
    """The global RoPE and, for Gemma 3, the sliding layers' own. transformers >= 5 writes Gemma 3's
    `rope_parameters` per layer type; older configs write `rope_local_base_freq` beside `rope_theta`."""
    if arch != "Gemma3ForCausalLM":
        return _rope_from_dict(raw), None
    params = raw.get("rope_parameters") or {}
    if "full_attention" in params:
        return (_rope_from_dict(raw, params["full_attention"]),
                _rope_from_dict(raw, params.get("sliding_attention") or {"rope_theta": 10000.0}))
    return _rope_from_dict(raw, default_theta=1_000_000.0), RopeConfig(theta=float(raw.get("rope_local_base_freq",
                                                                                            10000.0)))


def _rope_from_dict(raw: dict, params: dict | None = None, default_theta: float = 10000.0) -> RopeConfig:
    # transformers >= 5 writes `rope_parameters` (theta included); older configs write
    # `rope_theta` and an optional `rope_scaling`.
    params = dict(params or raw.get("rope_parameters") or raw.get("rope_scaling") or {})
    theta = float(params.get("rope_theta", raw.get("rope_theta", default_theta)))
    rope_type = params.get("rope_type", params.get("type", "default"))
    original = int(params.get("original_max_position_embeddings", raw.get("original_max_position_embeddings", 8192)))
    short_factor, attention_factor = None, 1.0
    if rope_type == "longrope":
        short_factor = tuple(float(f) for f in params["short_factor"])
        # As transformers: sqrt(1 + ln(factor) / ln(original context)), factor the context's growth.
        factor = float(params.get("factor") or int(raw.get("max_position_embeddings", original)) / original)
        attention_factor = float(params.get("attention_factor") or (
            1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(original))))
    return RopeConfig(
        theta=theta,
        rope_type=rope_type,
        factor=float(params.get("factor") or 1.0),
        low_freq_factor=float(params.get("low_freq_factor", 1.0)),
        high_freq_factor=float(params.get("high_freq_factor", 4.0)),
        original_max_position_embeddings=original,
        short_factor=short_factor,
        attention_factor=attention_factor,
    )


def _sliding_windows(raw: dict, arch: str, layers: int) -> tuple[int | None, ...]:
    window = raw.get("sliding_window")
    if arch in ("Qwen2ForCausalLM", "Qwen3ForCausalLM") and not raw.get("use_sliding_window", False):
        window = None
    if window is None:
        return (None,) * layers
    layer_types = raw.get("layer_types")
    if layer_types is None and arch in ("Qwen2ForCausalLM", "Qwen3ForCausalLM"):  # as transformers derives them
        first = int(raw.get("max_window_layers", 0))
        layer_types = ["sliding_attention" if i >= first else "full_attention" for i in range(layers)]
    if layer_types is None and arch in _GEMMA_PATTERN:
        pattern = int(raw.get("sliding_window_pattern", _GEMMA_PATTERN[arch]))
        layer_types = ["sliding_attention" if (i + 1) % pattern else "full_attention" for i in range(layers)]
    if layer_types is None:
        return (int(window),) * layers
    return tuple(int(window) if t == "sliding_attention" else None for t in layer_types)
