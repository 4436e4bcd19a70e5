"""Turns a scheduled step into one forward pass and the next tokens."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from data_plane.engine.block_manager import BlockManager
from data_plane.engine.grammar import TokenMasks
from data_plane.engine.persistent_batch import PersistentBatch
from data_plane.engine.sampler import HostTokens, SamplingBatch, sample
from data_plane.engine.scheduler import ScheduledSeq
from data_plane.engine.sequence import Sequence, TokenOut
from data_plane.engine.step_inputs import SeqStep, StepInputBuilder, StepInputs
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
        self.rows = PersistentBatch(blocks.table.shape[0])  # each running sequence's fixed state, by its row
        # The step prepared last: its sampled ids (filled when it executes) and each sampling sequence's row in them.
        self._sampled_at: tuple[_DeviceIds, dict[Sequence, int]] = (_DeviceIds(), {})
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
        sequence whose last token is pending (sampled by the step prepared before this one, its id not yet
        read) decodes it from that step's ids on the device: ``execute`` writes them into the input ids.
        Call it once the step before has been executed (launched, on CUDA): this one's uploads and device
        writes then queue behind it."""
        # Sequences of one adapter run side by side: each adapter's tokens are then one contiguous
        # run, which the CPU LoRA path slices instead of gathering. Outputs return in batch order.
        slots = [item.seq.slot for item in batch]
        order = sorted(range(len(batch)), key=slots.__getitem__)
        hold = self.rows.hold
        sampled_ids, fed_from, sampled_at = _DeviceIds(), None, {}
        steps, token_ids, sampled_rows, counters, sampled_positions, feed = [], [], [], [], [], []
        for k in order:  # the one walk over the step's sequences: a few integers each, what moves
            item = batch[k]
            seq, num_new = item.seq, item.num_new
            start = seq.num_computed + item.num_cached
            num_tokens = seq.num_tokens
            samples = start + num_new == num_tokens
            row = hold(seq)
            steps.append(SeqStep(row, start, num_new, seq.slot, samples))
            token_ids += seq.token_slice(start, start + num_new)
            if seq.pending:  # its last token is the one the step before sampled for it
                fed_from, source = self._source(seq, start + num_new, fed_from)
                token_ids[-1] = 0
                feed.append((len(token_ids) - 1, source))
            if samples:
                sampled_at[seq] = len(sampled_rows)
                sampled_rows.append(row)
                counters.append(num_tokens)
                sampled_positions.append(k)
        inputs = self.inputs.build(steps, token_ids, *self.step_runner.padding(len(steps), len(token_ids)))
        sampling = self.rows.sampling(sampled_rows, counters, self.device) if sampled_rows else None
        self._sampled_at = (sampled_ids, sampled_at)
        return PreparedStep(inputs, order, sampling, sampled_positions, sampled_ids, fed_from,
                            self._feed_tensor(feed) if feed else None)

    def _source(self, seq: Sequence, end: int, fed_from: _DeviceIds | None) -> tuple[_DeviceIds, int]:
        """(the ids of the step prepared last, ``seq``'s row in them): where its pending last token is."""
        ids, rows = self._sampled_at
        if seq.pending != 1 or end != seq.num_tokens or seq not in rows or fed_from not in (None, ids):
            raise RuntimeError(f"request {seq.request_id}'s step reads a token no step in flight samples: "
                               f"{seq.pending} pending, tokens up to {end} of {seq.num_tokens}")
        return ids, rows[seq]

    def _feed_tensor(self, feed: list[tuple[int, int]]) -> torch.Tensor:
        """[2, feeds] int64 on the device: each fed input's position in the step, and its row in the ids of
        the step before (a copy queued behind this step's upload)."""
        host = torch.tensor(list(zip(*feed, strict=True)), dtype=torch.int64, pin_memory=self.device.type == "cuda")
        return host.to(self.device, non_blocking=True)

    @torch.inference_mode()
    def execute(self, step: PreparedStep) -> StepTokens:
        """The forward pass and sampling of a prepared step (on the model thread); returns as soon as the
        tokens' copy to the host is started (on CUDA, before the device has run the step)."""
        if step.feed is not None:  # decoded tokens the step before sampled: from its ids, still on the device
            ids = step.inputs.input_ids
            ids.index_copy_(0, step.feed[0], step.fed_from.ids.index_select(0, step.feed[1]).to(ids.dtype))
        hidden = self.step_runner.forward(step.inputs)
        if step.sampling is None:
            return StepTokens(None, step.sampled_positions, len(step.order))
        # Grammar masks are computed on the host here, after the forward was launched: on a GPU, while it runs.
        grammars = step.sampling.grammar_rows
        masks = self.masks.fill(grammars, step.sampling.num_rows) if grammars else None
        logits = self.model.logits(hidden.index_select(0, step.inputs.sample_rows))
        sampled = sample(logits, step.sampling, masks)
        step.sampled_ids.ids = sampled.ids  # the next step's input ids, where it decodes these tokens
        # The one device->host copy of the step: the chosen tokens and the asked-for log-probabilities.
        return StepTokens(sampled.copy_to_host(), step.sampled_positions, len(step.order))


class _DeviceIds:
    """The ids a step samples, on the device: set by ``execute``, read by the next step's."""

    ids: torch.Tensor | None = None  # [sampled rows] int64


@dataclass(frozen=True)
class PreparedStep:
    inputs: StepInputs
    order: list[int]  # batch position of each sequence in the step's (adapter-sorted) token order
    sampling: SamplingBatch | None  # each sampled row's parameters, on the device; None: nothing samples
    sampled_positions: list[int]  # the batch position of each sampled row
    sampled_ids: _DeviceIds | None = None  # where execute leaves the sampled ids for the next step
    fed_from: _DeviceIds | None = None  # the step before's, when some input ids are its sampled ones
    feed: torch.Tensor | None = None  # [2, feeds] on the device: input position, row in fed_from's ids


@dataclass(frozen=True)
class StepTokens:
    """An executed step's tokens, on their way to the host (``HostTokens``)."""

    host: HostTokens | None  # None: nothing sampled
    sampled_positions: list[int]  # the batch position of each sampled row
    size: int  # the step's batch size

    def ready(self) -> bool:
        """Whether ``tokens`` would return without waiting for the device."""
        return self.host is None or self.host.ready()

    def tokens(self) -> list[TokenOut | None]:
        """Per item of the step's batch, its next token (None: it sampled nothing), once copied."""
        out: list[TokenOut | None] = [None] * self.size
        if self.host is not None:
            for k, tok in zip(self.sampled_positions, self.host.tokens(), strict=True):
                out[k] = tok
        return out
