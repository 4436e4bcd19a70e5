"""How a step's forward runs: eagerly, or replayed from CUDA graphs, decodes and prefill alike.

``EagerRunner`` calls the model on the step's inputs. ``GraphRunner`` pads every step to a captured
shape (``StepInputBuilder`` writes the padding into the same static buffers): a decode-only step to the
next batch-size bucket (``decode_buckets``), a step with prompt tokens to the next token-count bucket
(``token_buckets``) over a fixed number of sequences (``mixed_seqs``); on CUDA it then replays the graph
captured at that shape, one with LoRA and one without (a step with no adapter token builds no LoRA
metadata and pays nothing for LoRA). Only a step larger than every bucket runs eagerly, and is counted
(``eager_steps``); with the buckets up to the step's own bounds, none is. With ``capture=False`` the same
padded static-buffer step runs eagerly: that is the CPU test of the graph path.

Graphs are captured at warm-up, largest first, in one shared memory pool (a graph's intermediates are
free again for the next capture; what stays is the pool's largest step and every graph's output), with
the attention's host bound on context length set to the model's (``max_seq_len``), so the captured
kernels' grids cover any step of their shape. The unified attention kernel's grid depends only on the
token and sequence counts and on whether a sequence may have more than one query, which the shape and
its kind (decode-only or mixed) fix.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, replace
from typing import Protocol

import torch

from data_plane.engine.step_inputs import SeqStep, StepInputBuilder, StepInputs
from data_plane.model.attention import KVCache
from data_plane.model.llama import ForwardBatch, LlamaForCausalLM

log = logging.getLogger("lorafleet.engine")

# Token-count buckets of mixed steps double up to this, then grow by MIXED_STEP.
MIXED_DOUBLING_UP_TO = 512
MIXED_STEP = 256


def decode_buckets(max_seqs: int) -> list[int]:
    """Batch sizes decode steps are padded to: 1, 2, 4, 8, then every 8 up to 64, every 32 after that,
    and ``max_seqs`` itself; padding costs at most 7 rows up to 64 and under a third beyond."""
    sizes = {1, 2, 4, *range(8, 65, 8), *range(96, max_seqs + 1, 32), max_seqs}
    return sorted(s for s in sizes if s <= max_seqs)


def token_buckets(max_tokens: int) -> list[int]:
    """Token counts steps with prompt tokens are padded to: powers of two from 2 up to 512, then every 256,
    and ``max_tokens`` itself (such a step has at least 2 tokens); padding costs under half a step up to 512
    tokens and at most 255 tokens beyond."""
    doubling = [1 << i for i in range(1, MIXED_DOUBLING_UP_TO.bit_length())]
    sizes = {*doubling, *range(MIXED_DOUBLING_UP_TO + MIXED_STEP, max_tokens + 1, MIXED_STEP), max_tokens}
    return sorted(s for s in sizes if 2 <= s <= max_tokens)


def mixed_seqs(tokens: int, max_seqs: int) -> int:
    """The sequence count a step with prompt tokens is padded to at ``tokens`` tokens: one more than it can
    hold real sequences (a real one has a token at least, and one of them two), so a padding sequence is
    always there to hold the padding tokens."""
    return min(tokens, max_seqs + 1)


@dataclass(frozen=True)
class GraphShape:
    """A captured step's shape: its (padded) sequences and tokens, and whether it is decode-only (its
    attention grid then has no prefill items)."""

    seqs: int
    tokens: int
    decode_only: bool


@dataclass(frozen=True)
class CaptureReport:
    """What capturing the graphs took: how many, the seconds, and the device memory they hold (the pool)."""

    graphs: int
    seconds: float
    bytes: int


class StepRunner(Protocol):
    eager_steps: int  # steps no captured shape fits, run eagerly on a pod that replays graphs (0 where none are)

    def padding(self, num_seqs: int, num_tokens: int) -> tuple[int | None, int | None]:
        """(sequences, tokens) a step of this many real sequences and tokens is padded to; (None, None):
        not padded."""

    def forward(self, inputs: StepInputs) -> torch.Tensor:
        """Final hidden states, [num_tokens or more, hidden]: row t is the step's token t."""


class EagerRunner:
    """Every step eagerly, unpadded (CPU pods, ``--enforce-eager``): no step is counted as eager, since no
    graph was meant to run it."""

    eager_steps = 0

    def __init__(self, model: LlamaForCausalLM, kv_cache: KVCache) -> None:
        self.model = model
        self.kv_cache = kv_cache

    def padding(self, num_seqs: int, num_tokens: int) -> tuple[int | None, int | None]:
        return None, None

    def forward(self, inputs: StepInputs) -> torch.Tensor:
        return self.model(forward_batch(inputs, self.kv_cache))


class GraphRunner:
    def __init__(self, model: LlamaForCausalLM, kv_cache: KVCache, builder: StepInputBuilder,
                 decode_sizes: list[int], token_sizes: list[int], max_seq_len: int, capture: bool) -> None:
        """``decode_sizes``: the batch-size buckets of decode-only steps (``decode_buckets``);
        ``token_sizes``: the token-count buckets of steps with prompt tokens (``token_buckets``), each over
        ``mixed_seqs`` sequences; the builder must hold one sequence more than the largest decode bucket."""
        self.model = model
        self.kv_cache = kv_cache
        self.builder = builder
        self.decode_sizes = sorted(decode_sizes)
        self.token_sizes = sorted(token_sizes)
        self.max_seq_len = max_seq_len
        self.capture = capture
        max_seqs = self.decode_sizes[-1]
        self.shapes = {GraphShape(b, b, True) for b in self.decode_sizes} | {
            GraphShape(mixed_seqs(t, max_seqs), t, False) for t in self.token_sizes}
        self.eager_steps = 0
        self.captured: CaptureReport | None = None
        self._graphs: dict[tuple[GraphShape, bool], tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}

    def padding(self, num_seqs: int, num_tokens: int) -> tuple[int | None, int | None]:
        if num_tokens == num_seqs:
            if num_seqs > self.decode_sizes[-1]:
                return None, None
            size = next(b for b in self.decode_sizes if b >= num_seqs)
            return size, size
        if not self.token_sizes or num_tokens > self.token_sizes[-1]:
            return None, None
        tokens = next(b for b in self.token_sizes if b >= num_tokens)
        return mixed_seqs(tokens, self.decode_sizes[-1]), tokens

    def forward(self, inputs: StepInputs) -> torch.Tensor:
        shape = GraphShape(inputs.attn.seq_lens.shape[0], inputs.input_ids.shape[0], inputs.decode_only)
        if shape not in self.shapes:  # larger than every bucket: eagerly, as it is
            self.eager_steps += 1
            return self.model(forward_batch(inputs, self.kv_cache))
        captured = self._graphs.get((shape, _uses_lora(inputs)))
        if captured is None:  # not captured (yet, or not on this device): the same padded step, eagerly
            return self.model(forward_batch(self._bounded(inputs), self.kv_cache))
        graph, out = captured
        graph.replay()
        return out

    def capture_graphs(self, lora_slot: int | None) -> CaptureReport | None:
        """Captures every shape, with LoRA (its dummy tokens on ``lora_slot``; None: a model without LoRA
        layers) and, always, without; returns (and logs) what it took. Call once, after the KV cache is
        allocated and with no request running: the dummy steps write to block-table row 0's first blocks."""
        if not self.capture:
            return None
        start, free_before = time.monotonic(), torch.cuda.mem_get_info()[0]
        pool = torch.cuda.graph_pool_handle()
        for shape in sorted(self.shapes, key=lambda s: (s.tokens, s.seqs), reverse=True):
            for slot in ([-1] if lora_slot is None else [lora_slot, -1]):
                inputs = self._bounded(self.dummy_step(shape, slot))
                batch = forward_batch(inputs, self.kv_cache)
                for _ in range(2):  # compiles the Triton kernels and settles lazy allocations outside the graph
                    self.model(batch)
                torch.cuda.synchronize()
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=pool):
                    out = self.model(batch)
                self._graphs[shape, slot >= 0] = (graph, out)
        torch.cuda.synchronize()
        self.captured = CaptureReport(len(self._graphs), time.monotonic() - start,
                                      free_before - torch.cuda.mem_get_info()[0])
        log.info("cuda graphs captured", extra={
            "graphs": self.captured.graphs, "decode_buckets": self.decode_sizes, "token_buckets": self.token_sizes,
            "seconds": round(self.captured.seconds, 2), "memory_mib": round(self.captured.bytes / 2**20, 1)})
        return self.captured

    def dummy_step(self, shape: GraphShape, slot: int) -> StepInputs:
        """The inputs a graph of ``shape`` is captured on: one sequence on adapter ``slot`` (-1: none), of
        one token (decode-only) or two (a prompt), at block-table row 0, padded to the shape."""
        num_new = 1 if shape.decode_only else 2
        return self.builder.build([SeqStep(0, 0, num_new, slot, True)], [0] * num_new, pad_to=shape.seqs,
                                  pad_tokens=shape.tokens)

    def _bounded(self, inputs: StepInputs) -> StepInputs:
        """The step as a graph of its shape runs it: attention bounded by the model's context length."""
        return replace(inputs, attn=replace(inputs.attn, max_seq_len=self.max_seq_len))


def _uses_lora(inputs: StepInputs) -> bool:
    return inputs.lora is not None and inputs.lora.has_lora


def forward_batch(inputs: StepInputs, kv_cache: KVCache) -> ForwardBatch:
    return ForwardBatch(inputs.input_ids, inputs.positions, inputs.attn, kv_cache,
                        lora=inputs.lora if _uses_lora(inputs) else None)
