"""Per-request sampling: greedy, temperature, top-k, top-p, seeded; logprobs of the chosen token
and the top alternatives under the model's unscaled distribution."""

from __future__ import annotations

import torch

from data_plane.engine.sequence import Sequence, TokenOut


def sample(logits: torch.Tensor, seqs: list[Sequence]) -> list[TokenOut]:
    """``logits``: [len(seqs), vocab] float32, one row per sequence that needs a next token."""
    logprobs = torch.log_softmax(logits, dim=-1)  # [rows, vocab]
    greedy = [i for i, seq in enumerate(seqs) if seq.params.greedy]
    chosen = [0] * len(seqs)
    if greedy:  # one argmax over every greedy row
        for i, tok in zip(greedy, logits[greedy].argmax(dim=-1).tolist(), strict=True):
            chosen[i] = tok
    for i, seq in enumerate(seqs):
        if not seq.params.greedy:
            chosen[i] = _choose(logits[i], seq)
    max_top = max((s.params.logprobs for s in seqs), default=0)
    top_vals = top_ids = None
    if max_top:
        top_vals, top_ids = logprobs.topk(max_top, dim=-1)
        top_vals, top_ids = top_vals.tolist(), top_ids.tolist()
    chosen_lp = logprobs[torch.arange(len(seqs)), torch.tensor(chosen)].tolist()
    out = []
    for i, seq in enumerate(seqs):
        n = seq.params.logprobs
        top = tuple(zip(top_ids[i][:n], top_vals[i][:n], strict=True)) if n else ()
        out.append(TokenOut(chosen[i], chosen_lp[i], top))
    return out


def _choose(row: torch.Tensor, seq: Sequence) -> int:
    p = seq.params
    scaled = row / p.temperature
    if p.top_k:
        kth = scaled.topk(min(p.top_k, scaled.numel())).values[-1]
        scaled = scaled.masked_fill(scaled < kth, float("-inf"))
    probs = torch.softmax(scaled, dim=-1)
    if 0.0 < p.top_p < 1.0:
        sorted_probs, order = probs.sort(descending=True)
        # keep the smallest prefix whose mass reaches top_p (the token that crosses it included)
        drop = sorted_probs.cumsum(-1) - sorted_probs >= p.top_p
        sorted_probs = sorted_probs.masked_fill(drop, 0.0)
        probs = torch.zeros_like(probs).scatter_(0, order, sorted_probs)
    if seq.generator is None:
        seq.generator = torch.Generator()
        seq.generator.manual_seed(p.seed if p.seed is not None else torch.seed())
    return int(torch.multinomial(probs, 1, generator=seq.generator))
