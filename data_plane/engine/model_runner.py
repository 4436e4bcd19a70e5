"""Turns a scheduled step into one forward pass and the next tokens."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from data_plane.engine.sampler import SamplingBatch, sample
from data_plane.engine.scheduler import ScheduledSeq
from data_plane.engine.sequence import Sequence, TokenOut
from data_plane.lora.runtime import LoraRuntime
from data_plane.model.attention import KVCache, SeqSlice, build_attention_metadata
from data_plane.model.llama import ForwardBatch, LlamaForCausalLM


class ModelRunner:
    def __init__(self, model: LlamaForCausalLM, lora: LoraRuntime, kv_cache: KVCache) -> None:
        self.model = model
        self.lora = lora
        self.kv_cache = kv_cache
        self.device = model.embed_tokens.weight.device

    def run(self, batch: list[ScheduledSeq]) -> list[TokenOut | None]:
        """One forward over every scheduled chunk; a next token for each sequence whose known
        tokens are now all computed (None for a prefill chunk that is not the last)."""
        return self.execute(self.prepare(batch))

    @torch.inference_mode()
    def prepare(self, batch: list[ScheduledSeq]) -> PreparedStep:
        """The step's inputs, read from the sequences now. Call it where the sequences cannot change
        underneath (the engine's event loop): ``execute`` then needs nothing a request's end frees."""
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
            seqs.append(SeqSlice(tuple(s.block_table), start, item.num_new))
        attn = build_attention_metadata(seqs, self.kv_cache.block_size, self.model.windows, self.device)
        fb = ForwardBatch(
            input_ids=torch.tensor(ids, device=self.device),
            positions=torch.tensor(positions, device=self.device),
            attn=attn,
            kv_cache=self.kv_cache,
            lora=self.lora.step_metadata(slots),
        )
        ends = torch.tensor([i.num_new for i in items]).cumsum(0) - 1
        sampling = [j for j, item in enumerate(items) if item.samples]
        return PreparedStep(fb, order, ends[sampling].to(self.device), [items[j].seq for j in sampling],
                            [order[j] for j in sampling])

    @torch.inference_mode()
    def execute(self, step: PreparedStep) -> list[TokenOut | None]:
        """The forward pass and sampling of a prepared step (on the model thread)."""
        hidden = self.model(step.batch)
        out: list[TokenOut | None] = [None] * len(step.order)
        if not step.sampled_seqs:
            return out
        logits = self.model.logits(hidden[step.sample_rows])
        sampled = sample(logits, SamplingBatch.build(step.sampled_seqs, logits.device))
        for k, tok in zip(step.sampled_positions, sampled.to_host(), strict=True):
            out[k] = tok
        return out


@dataclass(frozen=True)
class PreparedStep:
    batch: ForwardBatch
    order: list[int]  # batch position of each sequence in the step's (adapter-sorted) token order
    sample_rows: torch.Tensor  # [samples] row of hidden states whose next token is sampled
    sampled_seqs: list[Sequence]  # the sequence of each of those rows (its sampling parameters)
    sampled_positions: list[int]  # the batch position of each of those rows
