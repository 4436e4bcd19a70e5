"""Assembles a pod's engine from its config: model, LoRA runtime, KV cache, warm-up."""

from __future__ import annotations

import logging
from pathlib import Path

import torch

from conventions.home import lorafleet_home
from data_plane.config import DataPlaneConfig
from data_plane.engine.engine import Engine, EngineLimits, Resolver
from data_plane.engine.scheduler import Policy
from data_plane.errors import AdapterNotFound
from data_plane.lora.peft_adapter import AdapterLimits
from data_plane.lora.runtime import LoraRuntime
from data_plane.metrics import PodMetrics
from data_plane.model import LlamaForCausalLM, cpu_linear, load_model
from data_plane.model.attention import KVCache
from data_plane.model.demo_model import ensure_demo_model
from data_plane.model.precision import AUTO, Precision, load_dtype
from data_plane.model.tokenizer import Tokenizer

log = logging.getLogger("lorafleet.pod")

# The largest decode step the start-up measurement of bfloat16 projections times (with 1 and 8 rows).
DECODE_ROWS_MEASURED = 128
# CPU pods get a fixed KV budget in tokens (the demo model needs ~46 KB per token in float32).
CPU_KV_TOKENS = 16384


def local_resolver(roots: tuple[Path, ...]) -> Resolver:
    """Resolves an adapter name to the directory of that name under the first root holding it."""

    async def resolve(name: str) -> tuple[str, str]:
        for root in roots:
            if (root / name / "adapter_config.json").is_file():
                return str(root / name), ""
        where = ", ".join(str(r) for r in roots) or "the pod was started without --adapter-root"
        raise AdapterNotFound(f"adapter {name!r} is not loaded and no adapter root holds a directory of that name "
                              f"({where}); load it through DataPlaneAdmin first")

    return resolve


def build_engine(config: DataPlaneConfig, metrics: PodMetrics, resolver: Resolver | None = None) -> Engine:
    """Loads the model, wraps it with LoRA slots, sizes the KV cache, warms up. Call inside the event loop."""
    model_dir = config.model or ensure_demo_model()
    device = torch.device(config.device)
    model = load_model(model_dir, load_dtype(config.dtype, config.device), device)
    set_precision(model, config.dtype, config.max_num_seqs)
    tokenizer = Tokenizer(model_dir)
    roots = config.adapter_roots
    # One cache directory per pod: a pod clears unfinished downloads in its directory at start-up.
    download_dir = config.adapter_cache_dir or lorafleet_home() / "adapter-cache" / config.resolved_pod_id
    lora = LoraRuntime(model, config.max_loras, config.max_cpu_loras, config.max_lora_rank,
                       config.max_num_batched_tokens, roots,
                       AdapterLimits(config.max_lora_rank, config.max_adapter_bytes, config.allow_pickle_adapters),
                       download_dir, config.adapter_download_timeout_s)
    limits = EngineLimits(
        max_num_seqs=config.max_num_seqs, max_num_batched_tokens=config.max_num_batched_tokens,
        max_waiting=config.max_waiting, block_size=config.block_size,
        num_kv_blocks=config.num_kv_blocks or _auto_kv_blocks(model, config),
        max_model_len=model.config.max_position_embeddings, max_queue_delay_s=config.max_queue_delay_s,
    )
    engine = Engine(model, tokenizer, lora, limits, resolver or local_resolver(roots), metrics,
                    config.fair_share_weights, Policy(config.scheduling_policy))
    engine.warm_up()
    log.info("engine ready", extra={"model": str(model_dir), "kv_blocks": limits.num_kv_blocks,
                                    "max_loras": config.max_loras, "device": config.device})
    return engine


def set_precision(model: LlamaForCausalLM, setting: str, max_num_seqs: int) -> Precision:
    """Makes ``model`` (loaded in ``load_dtype(setting, ...)``) compute in the precision ``--dtype
    setting`` names, and returns it, logged. "auto" keeps the loaded precision, except that a float32
    CPU model takes bfloat16 projections where they measure faster on its own weights, at decode row
    counts up to ``max_num_seqs`` (``cpu_linear.choose_precision``)."""
    reason, timings = f"--dtype {setting}", {}
    if setting == AUTO and model.precision is Precision.FLOAT32 and model.head_weight.device.type == "cpu":
        n = min(max_num_seqs, DECODE_ROWS_MEASURED)
        choice = cpu_linear.choose_precision(model.matmul_weights(), sorted({1, min(8, n), n}))
        precision, reason = choice.precision, f"--dtype auto: {choice.reason}"
        timings = {f"{p.value}_ms": round(t * 1e3, 3) for p, t in choice.seconds.items()}
    else:
        precision = model.precision if setting == AUTO else Precision(setting)
    if precision is not model.precision:  # load_model packed the projections in the weights' dtype
        model.prepack_cpu_weights(precision.matmul_dtype)
    if precision is not model.precision:
        raise ValueError(f"--dtype {setting}: a model of {model.embed_tokens.weight.dtype} weights on "
                         f"{model.head_weight.device.type} cannot compute in {precision.value}")
    log.info("precision", extra={"precision": model.precision.value, "reason": reason, **timings})
    return model.precision


def _auto_kv_blocks(model, config: DataPlaneConfig) -> int:
    c = model.config
    per_block = KVCache.bytes_per_block(c.num_layers, config.block_size, c.num_kv_heads, c.head_dim,
                                        model.embed_tokens.weight.dtype)
    if config.device != "cuda":
        return CPU_KV_TOKENS // config.block_size
    # What is left after weights and slot buffers, keeping headroom for activations of the largest step.
    free, total = torch.cuda.mem_get_info()
    budget = free - (1 - config.gpu_memory_utilization) * total
    blocks = int(budget // per_block)
    if blocks < 4:
        raise RuntimeError(f"only {budget / 2**30:.2f} GiB of GPU memory is left for the KV cache; lower "
                           "--max-loras/--max-lora-rank or raise --gpu-memory-utilization")
    return blocks
