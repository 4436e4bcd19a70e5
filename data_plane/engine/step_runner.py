"""How a step's forward runs: eagerly, or (decode steps) replayed from CUDA graphs.

``EagerRunner`` calls the model on the step's inputs. ``GraphRunner`` pads every decode-only step of
at most its largest bucket to the next bucket size (``StepInputBuilder`` writes the padding into the
same static buffers), then on CUDA replays the graph captured at that size, one with LoRA and one
without (a step with no adapter token pays nothing for LoRA); steps with prefill tokens run eagerly.
With ``capture=False`` the same padded static-buffer step runs eagerly: that is the CPU test of the
graph path, and what ``--enforce-eager`` would run if padding were wanted without graphs.

Graphs are captured at warm-up, largest first, in one shared memory pool, with the attention's host
bound on context length set to the model's (``max_seq_len``), so the captured kernels' grids cover
any step of their size.
"""

from __future__ import annotations

import logging
import time
from dataclasses import replace
from typing import Protocol

import torch

from data_plane.engine.step_inputs import SeqStep, StepInputBuilder, StepInputs
from data_plane.model.attention import KVCache
from data_plane.model.llama import ForwardBatch, LlamaForCausalLM

log = logging.getLogger("lorafleet.engine")


def decode_buckets(max_seqs: int) -> list[int]:
    """Batch sizes decode steps are padded to: 1, 2, 4, 8, then every 8 up to 64, every 32 after that,
    and ``max_seqs`` itself; padding costs at most 7 rows up to 64 and under a third beyond."""
    sizes = {1, 2, 4, *range(8, 65, 8), *range(96, max_seqs + 1, 32), max_seqs}
    return sorted(s for s in sizes if s <= max_seqs)


class StepRunner(Protocol):
    def padded_size(self, num_seqs: int, decode_only: bool) -> int | None:
        """The sequence count the step's inputs are padded to; None: not padded."""

    def forward(self, inputs: StepInputs) -> torch.Tensor:
        """Final hidden states, [num_tokens or more, hidden]: row t is the step's token t."""


class EagerRunner:
    def __init__(self, model: LlamaForCausalLM, kv_cache: KVCache) -> None:
        self.model = model
        self.kv_cache = kv_cache

    def padded_size(self, num_seqs: int, decode_only: bool) -> int | None:
        return None

    def forward(self, inputs: StepInputs) -> torch.Tensor:
        return self.model(forward_batch(inputs, self.kv_cache))


class GraphRunner:
    def __init__(self, model: LlamaForCausalLM, kv_cache: KVCache, builder: StepInputBuilder, buckets: list[int],
                 max_seq_len: int, capture: bool) -> None:
        self.model = model
        self.kv_cache = kv_cache
        self.builder = builder
        self.buckets = sorted(buckets)
        self.max_seq_len = max_seq_len
        self.capture = capture
        self._graphs: dict[tuple[int, bool], tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}

    def padded_size(self, num_seqs: int, decode_only: bool) -> int | None:
        if not decode_only or num_seqs > self.buckets[-1]:
            return None
        return next(b for b in self.buckets if b >= num_seqs)

    def forward(self, inputs: StepInputs) -> torch.Tensor:
        size = inputs.attn.seq_lens.shape[0]
        if not inputs.decode_only or size not in self.buckets:
            return self.model(forward_batch(inputs, self.kv_cache))
        captured = self._graphs.get((size, _uses_lora(inputs)))
        if captured is None:  # not captured (yet, or not on this device): the same padded step, eagerly
            return self.model(forward_batch(self._bounded(inputs), self.kv_cache))
        graph, out = captured
        graph.replay()
        return out

    def capture_graphs(self, lora_slot: int | None) -> None:
        """Captures every bucket, with LoRA (its dummy tokens on ``lora_slot``) and, always, without.
        Call once, after the KV cache is allocated and with no request running: the dummy steps write
        to block-table row 0's first block."""
        if not self.capture:
            return
        start, free_before = time.monotonic(), torch.cuda.mem_get_info()[0]
        pool = torch.cuda.graph_pool_handle()
        for size in reversed(self.buckets):
            for slot in ([-1] if lora_slot is None else [lora_slot, -1]):
                inputs = self._bounded(self.builder.build([SeqStep(0, 0, 1, slot, True)], [0], pad_to=size))
                batch = forward_batch(inputs, self.kv_cache)
                for _ in range(2):  # compiles the Triton kernels and settles lazy allocations outside the graph
                    self.model(batch)
                torch.cuda.synchronize()
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=pool):
                    out = self.model(batch)
                self._graphs[size, slot >= 0] = (graph, out)
        torch.cuda.synchronize()
        log.info("cuda graphs captured", extra={
            "graphs": len(self._graphs), "buckets": self.buckets, "seconds": round(time.monotonic() - start, 2),
            "memory_mib": round((free_before - torch.cuda.mem_get_info()[0]) / 2**20, 1)})

    def _bounded(self, inputs: StepInputs) -> StepInputs:
        """The step as a graph of its size runs it: attention bounded by the model's context length."""
        return replace(inputs, attn=replace(inputs.attn, max_seq_len=self.max_seq_len))


def _uses_lora(inputs: StepInputs) -> bool:
    return inputs.lora is not None and inputs.lora.has_lora


def forward_batch(inputs: StepInputs, kv_cache: KVCache) -> ForwardBatch:
    return ForwardBatch(inputs.input_ids, inputs.positions, inputs.attn, kv_cache,
                        lora=inputs.lora if _uses_lora(inputs) else None)
