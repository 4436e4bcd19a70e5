"""KV-cache sizing on CUDA (the device's figures stubbed, so it runs here): the cache takes what
--gpu-memory-utilization leaves after the largest step's peak and, where steps replay CUDA graphs, the graphs'
pool: the largest step's intermediates, the decode workspace of its sequences and every graph's output."""

from __future__ import annotations

import pytest
import torch

from data_plane import pod
from data_plane.config import DataPlaneConfig
from data_plane.engine.step_runner import decode_buckets, token_buckets
from data_plane.model.attention import KVCache
from tests.data_plane.tiny_model import tiny_model

GIB = 1 << 30
PEAK, STEP, TOTAL, FREE, RESERVED = 3 * GIB, GIB // 2, 16 * GIB, 12 * GIB, 3 * GIB


@pytest.fixture
def cuda_figures(monkeypatch):
    monkeypatch.setattr(pod, "profile_largest_step", lambda model, lora, config: (PEAK, STEP))
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda: (FREE, TOTAL))
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda: RESERVED)


def _blocks(model, config) -> int:
    return pod.kv_cache_blocks(model, None, config)  # the LoRA runtime is only read by the (stubbed) profile


def test_the_kv_cache_leaves_room_for_the_graph_pool_unless_steps_run_eagerly(cuda_figures):
    model = tiny_model()
    c = model.config
    config = DataPlaneConfig(device="cuda", dtype="float32", max_num_seqs=32, max_num_batched_tokens=1024)
    per_block = KVCache.bytes_per_block(c.num_layers, config.block_size, c.num_kv_heads, c.head_dim, torch.float32)
    other = TOTAL - FREE - RESERVED
    eager = _blocks(model, DataPlaneConfig(device="cuda", dtype="float32", max_num_seqs=32,
                                           max_num_batched_tokens=1024, enforce_eager=True))
    assert eager == int(0.9 * TOTAL - PEAK - other) // per_block

    pool = pod.graph_pool_bytes(model, config, STEP)
    # 33 sequences (the largest mixed step's) x heads x 16 splits of (head_dim + 2) float32, and their counters
    workspace = 33 * c.num_heads * 16 * (c.head_dim + 2) * 4 + 33 * c.num_kv_heads * 4
    outputs = (sum(decode_buckets(32)) + sum(token_buckets(1024))) * c.hidden_size * 4 * 2  # with and without LoRA
    assert pool == STEP + workspace + outputs
    assert _blocks(model, config) == int(0.9 * TOTAL - PEAK - pool - other) // per_block < eager

    without_lora = DataPlaneConfig(device="cuda", dtype="float32", max_num_seqs=32, max_num_batched_tokens=1024,
                                   enable_lora=False)
    assert pod.graph_pool_bytes(model, without_lora, STEP) == STEP + workspace + outputs // 2  # one graph a shape
