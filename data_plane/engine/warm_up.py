"""Start-up work of an engine: every kernel and buffer a step needs built before requests wait, the
CUDA graphs captured, and steps of a few shapes timed as the step-time model's prior."""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING

from data_plane.engine.progress import ScheduledSeq, step_shape
from data_plane.engine.sequence import SamplingParams, Sequence
from data_plane.engine.step_cost import MIN_PREFILL_TOKENS

if TYPE_CHECKING:  # the engine calls in here: only its type is named
    from data_plane.engine.engine import Engine

log = logging.getLogger("lorafleet.engine")


def warm_up(engine: Engine, rank: int = 8) -> None:
    """Fills every adapter slot with a zero adapter and runs, on the model thread, a one-sequence
    decode step, a full decode batch and a full prefill chunk through every slot, so that no
    oneDNN kernel or buffer is first built while requests wait (CPU projections run in one row
    tile, ``cpu_linear``: one kernel per weight shape); then captures the CUDA graphs, where the engine
    uses them, and times the step-time model's prior (``time_steps``). On a pod without LoRA every step
    is of the base model."""
    cache = engine.lora.cache
    limits = engine.limits
    cache.fill_with_dummies(min(rank, engine.lora.limits.max_rank))
    n = min(limits.max_num_seqs, limits.num_kv_blocks)
    decodes = [Sequence(f"warm-up-{i}", None, [0], SamplingParams(), 2, slot=_slot(i, cache.max_loras))
               for i in range(n)]
    for size in sorted({1, n}):
        engine.run_alone([ScheduledSeq(seq, 1) for seq in decodes[:size]])
    chunk = min(limits.max_num_batched_tokens, limits.num_kv_blocks * limits.block_size, limits.max_model_len)
    prefill = Sequence("warm-up-prefill", None, [0] * chunk, SamplingParams(), chunk + 1,
                       slot=_slot(0, cache.max_loras))
    engine.run_alone([ScheduledSeq(prefill, chunk)])
    engine.on_model_thread(engine.runner.capture_graphs)
    time_steps(engine, decodes, min(chunk, 256), chunk)
    log.info("step-time model from start-up steps: %s; prefill budget beside 1 decode %d tokens, beside %d "
             "decodes %d tokens", engine.costs.summary(), engine.costs.prefill_budget(1, 1), n,
             engine.costs.prefill_budget(n, min(n, cache.max_loras)))
    cache.clear_free_slots()


def time_steps(engine: Engine, decodes: list[Sequence], tokens: int, chunk: int) -> None:
    """Times steps of a few shapes, built and warmed already, as the step-time model's prior: decodes
    with and without adapters, prefill in one and two sequences, decodes beside prefill, and where
    projections run in row tiles decodes beside a few prompt tokens and a prompt beside one decode that
    fills a tile and one a token longer (steps of at most ``chunk`` tokens, of at most ``max_num_seqs``
    sequences)."""
    slot = _slot(0, engine.lora.cache.max_loras)

    def prompt(name: str, length: int) -> Sequence:
        return Sequence(name, None, [0] * length, SamplingParams(), length + 1, slot=slot)

    base = Sequence("warm-up-base", None, [0], SamplingParams(), 2)
    half = max(1, tokens // 2)
    beside = max(1, min(half, chunk - len(decodes) + 1))
    few = min(beside, MIN_PREFILL_TOKENS)
    batches = [[ScheduledSeq(base, 1)], [ScheduledSeq(decodes[0], 1)], [ScheduledSeq(seq, 1) for seq in decodes],
               [ScheduledSeq(prompt("warm-up-p", tokens), tokens)],
               [ScheduledSeq(prompt("warm-up-p1", half), half), ScheduledSeq(prompt("warm-up-p2", half), half)],
               [*(ScheduledSeq(seq, 1) for seq in decodes[:-1]), ScheduledSeq(prompt("warm-up-p", beside), beside)]]
    tile = engine.costs.row_tile
    if tile:
        # A few prompt tokens beside the decodes, within their tile. Where row tiles are not modelled, a few
        # tokens that cross a tile (model/cpu_linear.py) would be taken for a cost of every prefilling sequence.
        batches.append([*(ScheduledSeq(seq, 1) for seq in decodes[:-1]), ScheduledSeq(prompt("warm-up-f", few), few)])
    if tile and tile + 1 <= chunk:
        # A prompt that fills one decode's tile, and one a token longer that needs a second tile.
        batches += [[ScheduledSeq(decodes[0], 1), ScheduledSeq(prompt(f"warm-up-t{n}", n), n)]
                    for n in (tile - 1, tile)]
    for batch in batches:
        if len(batch) > engine.limits.max_num_seqs:
            continue
        start = time.monotonic()
        if engine.run_alone(batch):
            engine.costs.observe_prior(step_shape(batch), time.monotonic() - start)


def _slot(i: int, max_loras: int) -> int:
    """The adapter slot of the ``i``-th warm-up sequence: the slots in turn; -1 (the base model) on a pod
    without LoRA."""
    return i % max_loras if max_loras else -1
