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
        ids, positions, slots, seqs = [], [], [], []
        for item in batch:
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
        ends = torch.tensor([i.num_new for i in batch]).cumsum(0) - 1
        sampling = [k for k, item in enumerate(batch) if item.samples]
        if not sampling:
            return [None] * len(batch)
        logits = self.model.logits(hidden[ends[sampling].to(self.device)]).cpu()
        tokens = sample(logits, [batch[k].seq for k in sampling])
        out: list[TokenOut | None] = [None] * len(batch)
        for k, tok in zip(sampling, tokens, strict=True):
            out[k] = tok
        return out
