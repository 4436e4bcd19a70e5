"""Turns a scheduled step into one forward pass and the next tokens."""

from __future__ import annotations

import torch

from data_plane.engine.sampler import sample
from data_plane.engine.scheduler import ScheduledSeq
from data_plane.engine.sequence import TokenOut
from data_plane.lora.runtime import LoraRuntime
from data_plane.model.attention import KVCache, SeqSlice, build_attention_metadata
from data_plane.model.llama import ForwardBatch, LlamaForCausalLM


class ModelRunner:
    def __init__(self, model: LlamaForCausalLM, lora: LoraRuntime, kv_cache: KVCache) -> None:
        self.model = model
        self.lora = lora
        self.kv_cache = kv_cache
        self.device = model.embed_tokens.weight.device

    @torch.inference_mode()
    def run(self, batch: list[ScheduledSeq]) -> list[TokenOut | None]:
        """One forward over every scheduled chunk; a next token for each sequence whose known
        tokens are now all computed (None for a prefill chunk that is not the last)."""
        # Sequences of one adapter run side by side: each adapter's tokens are then one contiguous
        # run, which the CPU LoRA path slices instead of gathering. Outputs return in batch order.
        order = sorted(range(len(batch)), key=lambda k: batch[k].seq.slot)
        items = [batch[k] for k in order]
        ids, positions, slots, seqs = [], [], [], []
        for item in items:
            s = item.seq
            start = s.num_computed
            ids += s.all_ids[start : start + item.num_new]
            positions += range(start, start + item.num_new)
            slots += [s.slot] * item.num_new
            seqs.append(SeqSlice(s.block_table, start, item.num_new))
        attn = build_attention_metadata(seqs, self.kv_cache.block_size, self.model.windows, self.device)
        fb = ForwardBatch(
            input_ids=torch.tensor(ids, device=self.device),
            positions=torch.tensor(positions, device=self.device),
            attn=attn,
            kv_cache=self.kv_cache,
            lora=self.lora.step_metadata(slots),
        )
        hidden = self.model(fb)
        ends = torch.tensor([i.num_new for i in items]).cumsum(0) - 1
        sampling = [j for j, item in enumerate(items) if item.samples]
        out: list[TokenOut | None] = [None] * len(batch)
        if not sampling:
            return out
        logits = self.model.logits(hidden[ends[sampling].to(self.device)]).cpu()
        tokens = sample(logits, [items[j].seq for j in sampling])
        for j, tok in zip(sampling, tokens, strict=True):
            out[order[j]] = tok
        return out
