"""Turns a scheduled step into one forward pass and the next tokens."""

from __future__ import annotations

from dataclasses import dataclass
from itertools import compress
from operator import add, eq

import torch

from data_plane.engine.block_manager import BlockManager
from data_plane.engine.grammar import TokenMasks
from data_plane.engine.persistent_batch import PersistentBatch
from data_plane.engine.sampler import HostTokens, SamplingBatch, sample
from data_plane.engine.scheduler import ScheduledSeq
from data_plane.engine.sequence import Sequence, TokenOut
from data_plane.engine.step_inputs import StepInputBuilder, StepInputs
from data_plane.engine.step_runner import EagerRunner, GraphRunner, StepRunner, decode_buckets, token_buckets
from data_plane.lora.runtime import LoraRuntime
from data_plane.model.attention import KVCache
from data_plane.model.llama import LlamaForCausalLM
from kernels.lora_meta import LoraMetaBuilder


class ModelRunner:
    def __init__(self, model: LlamaForCausalLM, lora: LoraRuntime | None, kv_cache: KVCache, blocks: BlockManager,
                 max_seqs: int, max_tokens: int, graphs: bool = False) -> None:
        """``lora``: None, or a runtime with LoRA off, for a model without LoRA layers; ``graphs``: every step
        padded to a bucket and replayed from CUDA graphs (on CUDA), captured by ``capture_graphs``; else every
        step runs eagerly, unpadded."""
        self.model = model
        self.lora = lora = lora if lora is not None and lora.enabled else None
        self.kv_cache = kv_cache
        self.device = model.embed_tokens.weight.device
        meta = dict(lora_meta=LoraMetaBuilder, max_loras=lora.cache.max_loras, max_rank=lora.limits.max_rank,
                    lora_partial_rows=lora.partial_rows) if lora is not None else {}
        # A step with prompt tokens is padded to one sequence more than a step holds (step_runner.mixed_seqs).
        self.inputs = StepInputBuilder(blocks, kv_cache, max_seqs + 1 if graphs else max_seqs, max_tokens,
                                       self.device, **meta)
        self.masks = TokenMasks(max_seqs, model.config.vocab_size, self.device)
        # each running sequence's fixed state and last sampled token, by its row
        self.rows = PersistentBatch(blocks.table.shape[0], self.device)
        # A graph's attention covers the longest context a sequence can have: the model's, the cache's, or
        # what a block-table row holds.
        max_context = min(model.config.max_position_embeddings,
                          min(kv_cache.num_blocks, blocks.max_blocks_per_seq) * kv_cache.block_size)
        self.step_runner: StepRunner = (
            GraphRunner(model, kv_cache, self.inputs, decode_buckets(max_seqs), token_buckets(max_tokens),
                        max_context, capture=self.device.type == "cuda")
            if graphs else EagerRunner(model, kv_cache))

    @torch.inference_mode()
    def capture_graphs(self) -> None:
        if isinstance(self.step_runner, GraphRunner):
            self.step_runner.capture_graphs(0 if self.lora is not None else None)

    def run(self, batch: list[ScheduledSeq]) -> list[TokenOut | None]:
        """One forward over every scheduled chunk; a next token for each sequence whose known
        tokens are now all computed (None for a prefill chunk that is not the last)."""
        return self.execute(self.prepare(batch)).tokens()

    @torch.inference_mode()
    def prepare(self, batch: list[ScheduledSeq]) -> PreparedStep:
        """The step's inputs, read from the sequences now. Call it where the sequences cannot change
        underneath (the engine's event loop): ``execute`` then needs nothing a request's end frees. A
        sequence whose last token is pending (sampled by the step before this one, its id not yet read)
        decodes it from its row of the persistent batch's ids on the device, where that step writes it.
        Call it once the step before has been executed (launched, on CUDA): this one's uploads and device
        reads then queue behind it.

        Per sequence it reads its row, slot, progress and length in a few list comprehensions (no loop
        body per sequence, no object made per sequence); a decode step's tokens are each sequence's last
        (or, pending, read on the device), a step with prompt tokens slices each sequence's tokens."""
        n = len(batch)
        # Sequences of one adapter run side by side: each adapter's tokens are then one contiguous
        # run, which the CPU LoRA path slices instead of gathering. Outputs return in batch order.
        slots = [item.seq.slot for item in batch]
        order = None  # None: the batch's own order
        if n > 1 and min(slots) != max(slots):
            order = sorted(range(n), key=slots.__getitem__)
            batch = [batch[k] for k in order]
            slots = [slots[k] for k in order]
        seqs = [item.seq for item in batch]
        rows = [seq.kv_row for seq in seqs]
        num_new = [item.num_new for item in batch]
        starts = [seq.num_computed + item.num_cached for seq, item in zip(seqs, batch, strict=True)]
        ends = list(map(add, starts, num_new))
        samples = list(map(eq, ends, [len(seq.request.prompt_ids) + len(seq.output_ids) for seq in seqs]))
        persistent = self.rows
        persistent.hold_all(seqs, rows, slots)
        decode = num_new.count(1) == n and all(samples)  # each sequence computes its last token, and samples
        pending = [seq.pending for seq in seqs]
        fed: list[int] | range = ()
        if any(pending):
            fed = self._fed(seqs, rows, starts, num_new, samples, pending, decode)
        if decode:
            token_ids = [0] * n if len(fed) == n else \
                [seq.output_ids[-1] if seq.output_ids else seq.request.prompt_ids[-1] for seq in seqs]
        else:
            token_ids = []
            for seq, start, end in zip(seqs, starts, ends, strict=True):
                token_ids += seq.token_slice(start, end)
        if decode or all(samples):
            sampled_rows, counters, silent = rows, ends, ()
            sampled_positions = order or list(range(n))
        else:
            sampled_rows, counters = list(compress(rows, samples)), list(compress(ends, samples))
            silent = [row for row, s in zip(rows, samples, strict=True) if not s]
            sampled_positions = list(compress(order or range(n), samples))
        inputs = self.inputs.build_columns(rows, starts, num_new, slots, samples, token_ids,
                                           *self.step_runner.padding(n, len(token_ids)), fed=fed,
                                           fed_from=persistent.token_ids)
        sampling = persistent.sampling(sampled_rows, counters, self.device) if sampled_rows else None
        persistent.stepped(sampled_rows, counters, silent)
        return PreparedStep(inputs, order, sampling, sampled_positions, len(fed),
                            whole=order is None and len(sampled_positions) == n)

    def _fed(self, seqs: list[Sequence], rows: list[int], starts: list[int], num_new: list[int],
             samples: list[bool], pending: list[int], decode: bool) -> list[int] | range:
        """The token indices of the step whose ids are read on the device: the pending last token of each
        sequence that decodes it, which the step before sampled at its row. Raises where a step would read
        a token no step in flight samples."""
        n = len(seqs)
        if decode and pending.count(1) == n and self.rows.fed(rows, starts):
            return range(n)
        fed, offset = [], 0
        for i, seq in enumerate(seqs):
            offset += num_new[i]
            if not pending[i]:
                continue
            if pending[i] != 1 or num_new[i] != 1 or not samples[i] or not self.rows.fed([rows[i]], [starts[i]]):
                raise RuntimeError(f"request {seq.request_id}'s step reads a token no step in flight samples: "
                                   f"{seq.pending} pending, tokens {starts[i]} to {starts[i] + num_new[i]} of "
                                   f"{seq.num_tokens}")
            fed.append(offset - 1)
        return fed

    @torch.inference_mode()
    def execute(self, step: PreparedStep) -> StepTokens:
        """The forward pass and sampling of a prepared step (on the model thread); returns as soon as the
        tokens' copy to the host is started (on CUDA, before the device has run the step)."""
        hidden = self.step_runner.forward(step.inputs)
        if step.sampling is None:
            return StepTokens(None, step.sampled_positions, step.size)
        # Grammar masks are computed on the host here, after the forward was launched: on a GPU, while it runs.
        grammars = step.sampling.grammar_rows
        masks = self.masks.fill(grammars, step.sampling.num_rows) if grammars else None
        logits = self.model.logits(hidden.index_select(0, step.inputs.sample_rows))
        sampled = sample(logits, step.sampling, masks)
        # Each sampled id kept at its sequence's row, on the device: the next step's input id where it decodes it.
        self.rows.token_ids[step.inputs.sample_kv_rows] = sampled.ids.to(torch.int32)
        # The one device->host copy of the step: the chosen tokens and the asked-for log-probabilities.
        return StepTokens(sampled.copy_to_host(), step.sampled_positions, step.size, step.whole)


@dataclass(frozen=True)
class PreparedStep:
    inputs: StepInputs
    order: list[int] | None  # batch position of each sequence in the step's (adapter-sorted) token order; None: as is
    sampling: SamplingBatch | None  # each sampled row's parameters, on the device; None: nothing samples
    sampled_positions: list[int]  # the batch position of each sampled row
    fed: int = 0  # input ids read on the device: pending tokens the step before sampled
    whole: bool = False  # every sequence samples, in batch order: sampled_positions is range(size)

    @property
    def size(self) -> int:
        """The step's batch size."""
        return self.inputs.num_seqs


@dataclass(frozen=True)
class StepTokens:
    """An executed step's tokens, on their way to the host (``HostTokens``)."""

    host: HostTokens | None  # None: nothing sampled
    sampled_positions: list[int]  # the batch position of each sampled row
    size: int  # the step's batch size
    whole: bool = False  # every item sampled, in batch order

    def ready(self) -> bool:
        """Whether ``tokens`` would return without waiting for the device."""
        return self.host is None or self.host.ready()

    def tokens(self) -> list[TokenOut | None]:
        """Per item of the step's batch, its next token (None: it sampled nothing), once copied."""
        if self.whole:
            return self.host.tokens()
        out: list[TokenOut | None] = [None] * self.size
        if self.host is not None:
            for k, tok in zip(self.sampled_positions, self.host.tokens(), strict=True):
                out[k] = tok
        return out
