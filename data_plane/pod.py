"""Assembles a pod's engine from its config: model, LoRA runtime, KV cache, warm-up."""

from __future__ import annotations

import logging
import time
from pathlib import Path

import torch

from conventions.home import lorafleet_home
from data_plane.config import DEFAULT_CPU_KV_CACHE_BYTES, DataPlaneConfig
from data_plane.engine.block_manager import BlockManager
from data_plane.engine.engine import Engine, EngineLimits, Resolver
from data_plane.engine.model_runner import ModelRunner
from data_plane.engine.scheduler import Policy, ScheduledSeq
from data_plane.engine.sequence import SamplingParams, Sequence
from data_plane.engine.step_runner import decode_buckets, token_buckets
from data_plane.engine.threads import model_thread
from data_plane.engine.warm_up import warm_up
from data_plane.errors import AdapterNotFound
from data_plane.lora.fetcher import AdapterFetcher
from data_plane.lora.peft_adapter import AdapterLimits
from data_plane.lora.runtime import LoraRuntime
from data_plane.metrics import PodMetrics
from data_plane.model import LlamaForCausalLM, cpu_linear, load_model, row_rule
from data_plane.model.attention import KVCache
from data_plane.model.demo_model import ensure_demo_model
from data_plane.model.kv_scales import CALIBRATION_TEXT, use_fp8_kv_cache
from data_plane.model.precision import AUTO, Precision, load_dtype
from data_plane.model.tokenizer import Tokenizer

log = logging.getLogger("lorafleet.pod")

# The largest decode step the start-up measurement of bfloat16 projections times (with 1 and 8 rows).
DECODE_ROWS_MEASURED = 128

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
    model = load_model(model_dir, load_dtype(config.dtype, config.device), device, config.quantization)
    tokenizer = Tokenizer(model_dir)
    if config.kv_cache_dtype == "fp8":  # before the precision's log line, which names it
        use_fp8_kv_cache(model, model_dir, tokenizer.encode(CALIBRATION_TEXT))
    set_precision(model, config.dtype, config.max_num_seqs)
    roots = config.adapter_roots
    # One disk tier per pod: a pod clears unfinished downloads in its directory at start-up.
    fetcher = AdapterFetcher(config.fetch_settings(lorafleet_home() / "adapter-cache" / config.resolved_pod_id))
    lora = LoraRuntime(model, config.max_loras, config.max_cpu_loras, config.max_lora_rank,
                       config.max_num_batched_tokens, roots,
                       AdapterLimits(config.max_lora_rank, config.max_adapter_bytes, config.allow_pickle_adapters),
                       fetcher, enabled=config.enable_lora)
    if device.type == "cpu":  # probed on threads like the model thread's; the team ends with the thread
        with model_thread(config.resolved_compute_threads) as probing:
            probing.submit(use_row_rule, model, lora, config).result()
    limits = EngineLimits(
        max_num_seqs=config.max_num_seqs, max_num_batched_tokens=config.max_num_batched_tokens,
        max_waiting=config.max_waiting, block_size=config.block_size,
        num_kv_blocks=config.num_kv_blocks or kv_cache_blocks(model, lora, config),
        max_model_len=model.config.max_position_embeddings, max_queue_delay_s=config.max_queue_delay,
        target_itl_s=config.target_itl, itl_growth=config.itl_growth,
    )
    engine = Engine(model, tokenizer, lora, limits, resolver or local_resolver(roots), metrics,
                    config.fair_share_weights, Policy(config.scheduling_policy),
                    cuda_graphs=device.type == "cuda" and not config.enforce_eager,
                    prefix_caching=config.prefix_caching, precision=model.precision_name,
                    prefix_report_size=config.prefix_report_size, compute_threads=config.resolved_compute_threads,
                    async_scheduling=config.async_scheduling)
    warm_up(engine)  # every kernel and buffer a step needs built, the step-time model's prior timed
    log.info("engine ready", extra={"model": str(model_dir), "kv_blocks": limits.num_kv_blocks,
                                    "max_loras": lora.cache.max_loras, "lora": config.enable_lora,
                                    "device": config.device})
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
    log.info("precision", extra={"precision": model.precision_name, "reason": reason, **timings})
    return model.precision


def use_row_rule(model: LlamaForCausalLM, lora: LoraRuntime, config: DataPlaneConfig) -> row_rule.RowRule:
    """Probes which row tiles keep a row's bits on this CPU, in the model's own shapes, in steps up to the
    pod's sizes, and its LoRA layers' at ranks up to --max-lora-rank (``row_rule.probe``: the native LoRA
    kernel where it builds and keeps a row's bits, else tiles), makes the model and its LoRA layers use them,
    and returns them, logged (a warning where a path has no invariant tiling here, or runs the torch path
    for want of its native kernel). Call it on the threads the steps compute on."""
    c = model.config
    shapes = [row_rule.LoraShape(w.base.in_features, tuple(w.base.slices.values())) for w in lora.layers.values()]
    started = time.perf_counter()
    native = model.kv_cache_shape()[0] if config.cpu_attention == "native" else None
    lora_dtype = next((w.lora_a.dtype for w in lora.layers.values()), None)  # the activations' (native LoRA)
    rule = row_rule.probe([w for w, _ in model.matmul_weights()], model.precision.matmul_dtype, model.head_weight,
                          shapes, config.max_lora_rank, c.head_dim, c.num_heads // c.num_kv_heads,
                          config.max_num_batched_tokens, config.max_num_seqs, native, lora_dtype)
    model.use_row_rule(rule)
    for layer in lora.layers.values():
        layer.backend.use_row_tile(rule.lora_rows, native=rule.lora_native)
    extra = {"row_rule": rule.describe(), "probe_s": round(time.perf_counter() - started, 3)}
    if rule.native_note:
        log.warning("attention runs tiled: %s", rule.native_note, extra=extra)
    if rule.lora_note:
        log.warning("LoRA runs in row tiles: %s", rule.lora_note, extra=extra)
    if rule.broken:
        log.warning("no row tiling keeps every row's bits on this CPU: a request's tokens may depend on what "
                    "shares its step", extra=extra)
    else:
        log.info("row tiles", extra=extra)
    return rule


def kv_cache_blocks(model: LlamaForCausalLM, lora: LoraRuntime, config: DataPlaneConfig) -> int:
    """KV-cache blocks in --kv-cache-bytes; when that is 0, on CUDA in what --gpu-memory-utilization of the
    device leaves after a profile run of the largest step (``profile_largest_step``) and, where steps replay
    CUDA graphs, what their pool will hold (``graph_pool_bytes``), on CPU in DEFAULT_CPU_KV_CACHE_BYTES.
    Raises RuntimeError when fewer than 4 blocks fit."""
    c = model.config
    per_block = KVCache.bytes_per_block(c.num_layers, config.block_size, c.num_kv_heads, c.head_dim,
                                        model.kv_cache_shape()[0])  # 1 byte an element in FP8
    budget, sizes = config.kv_cache_bytes, {}
    if not budget and config.device != "cuda":
        budget = DEFAULT_CPU_KV_CACHE_BYTES
    elif not budget:
        peak, step = profile_largest_step(model, lora, config)
        graphs = 0 if config.enforce_eager else graph_pool_bytes(model, config, step)
        free, total = torch.cuda.mem_get_info()
        other = total - free - torch.cuda.memory_reserved()  # the CUDA context, other processes
        budget = int(config.gpu_memory_utilization * total - peak - graphs - other)
        sizes = {"device_gib": round(total / 2**30, 2), "profile_peak_gib": round(peak / 2**30, 2),
                 "graph_pool_gib": round(graphs / 2**30, 3), "outside_torch_gib": round(other / 2**30, 2)}
    blocks = budget // per_block
    if blocks < 4:
        raise RuntimeError(f"only {budget / 2**30:.2f} GiB is left for the KV cache ({blocks} blocks of "
                           f"{per_block} bytes); lower --max-loras/--max-lora-rank/--max-num-batched-tokens, raise "
                           "--gpu-memory-utilization, give --kv-cache-bytes, or run without CUDA graphs "
                           "(--enforce-eager)")
    log.info("kv cache sized", extra={"blocks": blocks, "block_bytes": per_block,
                                      "kv_cache_gib": round(blocks * per_block / 2**30, 3), **sizes})
    return blocks


def profile_largest_step(model: LlamaForCausalLM, lora: LoraRuntime, config: DataPlaneConfig,
                         rank: int = 8) -> tuple[int, int]:
    """(the CUDA memory the pod's largest step needs at its peak, weights and adapter slots included; the
    part of it the step itself allocates): a step of --max-num-batched-tokens tokens over as many sequences
    as sample in one step (up to --max-num-seqs), with a dummy adapter in every slot and the sequences spread
    over the slots (the base model's on a pod without LoRA), every one sampling with temperature, top-k,
    top-p and the most log-probabilities (the sampler's scratch)."""
    cache = lora.cache
    cache.fill_with_dummies(min(rank, lora.limits.max_rank))
    tokens = config.max_num_batched_tokens
    num_seqs = min(config.max_num_seqs, tokens)
    sizes = [tokens // num_seqs + (i < tokens % num_seqs) for i in range(num_seqs)]
    num_blocks = sum(-(-n // config.block_size) for n in sizes)
    blocks = BlockManager(num_blocks, config.block_size, num_seqs, num_blocks)
    runner = ModelRunner(model, lora, model.new_kv_cache(num_blocks, config.block_size), blocks, num_seqs, tokens)
    batch = []
    for i, n in enumerate(sizes):
        params = SamplingParams(temperature=1.0, top_k=50, top_p=0.9, logprobs=20)
        slot = i % cache.max_loras if cache.max_loras else -1
        seq = Sequence(f"profile-{i}", None, [0] * n, params, n + 1, slot=slot)
        blocks.allocate(seq, n)
        batch.append(ScheduledSeq(seq, n))
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    runner.run(batch)
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated()
    del runner, blocks
    cache.clear_free_slots()
    torch.cuda.empty_cache()
    return peak, peak - before


def graph_pool_bytes(model: LlamaForCausalLM, config: DataPlaneConfig, step_bytes: int) -> int:
    """What the CUDA graphs' one pool will hold, estimated before the KV cache takes the rest of the device:
    the largest captured step's intermediates (``step_bytes``, measured on the profile step of the same
    tokens; graphs captured later reuse them), the decode workspace of that step's sequences (the attention
    splits' partials, allocated inside the graph), and every graph's output (kept by its graph). The capture
    logs what the pool took."""
    from kernels.attention_unified import default_tiles  # Triton: the `cuda` extra

    c = model.config
    dtype = model.embed_tokens.weight.dtype
    seqs = config.max_num_seqs + 1  # the largest mixed step's (step_runner.mixed_seqs)
    splits = default_tiles(c.head_dim, dtype).max_splits
    workspace = seqs * c.num_heads * splits * (c.head_dim + 2) * 4 + seqs * c.num_kv_heads * 4  # float32, int32
    tokens = sum(decode_buckets(config.max_num_seqs)) + sum(token_buckets(config.max_num_batched_tokens))
    outputs = tokens * c.hidden_size * dtype.itemsize * (2 if config.enable_lora else 1)  # with and without LoRA
    return step_bytes + workspace + outputs
