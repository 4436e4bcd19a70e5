"""Generation in this process, without any server: ``lorafleet generate --local``.

The same engine a pod runs, with one sequence slot and one adapter slot.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path

from data_plane.config import DataPlaneConfig
from data_plane.engine.engine import Engine, StepOutput
from data_plane.engine.sequence import SamplingParams
from data_plane.metrics import PodMetrics
from data_plane.pod import build_engine


@asynccontextmanager
async def local_engine(model: Path | None = None, adapter_roots: tuple[Path, ...] = (), device: str = "cpu",
                       dtype: str = "float32", max_num_seqs: int = 1, max_loras: int = 1) -> AsyncIterator[Engine]:
    """A started engine on ``model`` (default: the demo model) resolving adapters under ``adapter_roots``,
    with ``max_loras`` adapter slots (one per adapter that may run in the same batch). It queues every
    request its caller sends (no --max-queue-delay): there is no other pod a refused one could go to."""
    config = DataPlaneConfig(model=model, device=device, dtype=dtype, max_loras=max_loras, max_cpu_loras=max_loras,
                             max_lora_rank=64, adapter_roots=adapter_roots, max_num_seqs=max_num_seqs,
                             max_num_batched_tokens=512, num_kv_blocks=0, max_queue_delay=0)
    engine = build_engine(config, PodMetrics())
    engine.start()
    try:
        yield engine
    finally:
        await engine.stop()


def prompt_ids(engine: Engine, prompt: str, chat: bool = True) -> list[int]:
    """``prompt`` as token ids, rendered as a user message when ``chat`` and the model has a template."""
    if chat and engine.tokenizer.has_chat_template:
        prompt = engine.tokenizer.render_chat([{"role": "user", "content": prompt}])
    return engine.tokenizer.encode(prompt)


async def generate_local(prompt: str, params: SamplingParams, model: Path | None = None,
                         adapter_dir: Path | None = None, chat: bool = True, device: str = "cpu",
                         dtype: str = "float32") -> AsyncIterator[StepOutput]:
    """Streams the completion of ``prompt`` with the PEFT adapter in ``adapter_dir`` applied if given."""
    roots = (adapter_dir.resolve().parent,) if adapter_dir else ()
    async with local_engine(model, roots, device, dtype) as engine:
        adapter = adapter_dir.resolve().name if adapter_dir else None
        async for out in engine.generate(prompt_ids(engine, prompt, chat), params, adapter):
            yield out
