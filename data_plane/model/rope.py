"""Rotary position embeddings (the half-split layout of Hugging Face checkpoints)."""

from __future__ import annotations

import math

import torch

from data_plane.model.config import RopeConfig


def inverse_frequencies(rope: RopeConfig, head_dim: int) -> torch.Tensor:  # [head_dim // 2]
    inv_freq = 1.0 / (rope.theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim))
    if rope.rope_type == "linear":
        return (inv_freq / rope.factor).float()
    if rope.rope_type == "longrope":  # Phi: each frequency slowed by its own short factor
        return (inv_freq / torch.tensor(rope.short_factor, dtype=torch.float64)).float()
    if rope.rope_type == "llama3":
        # Llama 3.1: long wavelengths are slowed by `factor`, short ones kept, and the band
        # between them interpolated smoothly.
        old_ctx = rope.original_max_position_embeddings
        low_wavelen = old_ctx / rope.low_freq_factor
        high_wavelen = old_ctx / rope.high_freq_factor
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > low_wavelen, inv_freq / rope.factor, inv_freq)
        smooth = (old_ctx / wavelen - rope.low_freq_factor) / (rope.high_freq_factor - rope.low_freq_factor)
        smoothed = (1 - smooth) * scaled / rope.factor + smooth * scaled
        medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
        return torch.where(medium, smoothed, scaled).float()
    return inv_freq.float()


class RotaryEmbedding(torch.nn.Module):
    """Applies RoPE to queries and keys at given positions, from a cos/sin table built once; with
    ``rotary_dim`` < ``head_dim`` (Phi's partial rotary factor) to the first ``rotary_dim`` of each head."""

    def __init__(self, rope: RopeConfig, head_dim: int, max_positions: int, rotary_dim: int | None = None) -> None:
        super().__init__()
        self.rope = rope
        self.head_dim = head_dim
        self.rotary_dim = rotary_dim or head_dim
        self.max_positions = max_positions
        self.register_buffer("cos", torch.empty(0), persistent=False)
        self.register_buffer("sin", torch.empty(0), persistent=False)

    def build(self, device: torch.device | str) -> None:
        """Fills the cos/sin tables in float32 on ``device``."""
        inv_freq = inverse_frequencies(self.rope, self.rotary_dim).to(device)
        freqs = torch.outer(torch.arange(self.max_positions, device=device, dtype=torch.float32), inv_freq)
        emb = torch.cat([freqs, freqs], dim=-1)  # [max_positions, rotary_dim]
        # sin with the first half negated: rotate_half(x) * sin == x.roll(rotary_dim // 2) * signed_sin
        self.cos, self.sin = emb.cos(), torch.cat([-freqs.sin(), freqs.sin()], dim=-1)
        if self.rope.attention_factor != 1.0:  # longrope scales both, as transformers does
            self.cos, self.sin = self.cos * self.rope.attention_factor, self.sin * self.rope.attention_factor

    def tables(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and signed sin at ``positions``: [tokens, 1, rotary_dim] each, once per step for every layer."""
        return self.cos[positions].to(dtype)[:, None, :], self.sin[positions].to(dtype)[:, None, :]

    def forward(self, tables: tuple[torch.Tensor, torch.Tensor], x: torch.Tensor) -> torch.Tensor:
        """``x``: [tokens, heads, head_dim] (queries and keys side by side: one call rotates both)."""
        cos, sin = tables
        if self.rotary_dim == self.head_dim:
            return torch.addcmul(x * cos, x.roll(self.head_dim // 2, dims=-1), sin)
        rot, rest = x.split([self.rotary_dim, self.head_dim - self.rotary_dim], dim=-1)
        return torch.cat([torch.addcmul(rot * cos, rot.roll(self.rotary_dim // 2, dims=-1), sin), rest], dim=-1)
