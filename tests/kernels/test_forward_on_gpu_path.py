"""The model on its GPU path (the Triton paged-attention backend, the Triton LoRA backend and the fused
Triton layer ops), run on CPU tensors under Triton's interpreter, computes what the CPU path computes, step
after step (prefill, chunked prefill beside decodes, padded decode), and nothing in its forward syncs with
the host."""

from __future__ import annotations

import contextlib

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from data_plane.engine.block_manager import BlockManager
from data_plane.engine.model_runner import ModelRunner
from data_plane.engine.scheduler import ScheduledSeq
from data_plane.engine.sequence import SamplingParams, Sequence
from data_plane.lora.layer import LoRAProjection
from data_plane.model.attention import KV_FP8
from data_plane.model.layer_ops import TorchOps
from data_plane.model.torch_attention import TorchAttention
from data_plane.model.triton_attention import TritonAttention
from data_plane.model.triton_layer_ops import TritonOps
from kernels.lora_backend import CpuBackend, TritonBackend
from tests.data_plane.tiny_model import tiny_lora, tiny_model
from tests.tolerances import logits_atol, longest_sum


class NoHostSync(TorchDispatchMode):
    """Fails on the aten ops that make the host wait for the device: reading a value (``.item()``,
    ``bool()``, ``int()``), outputs shaped by data (``nonzero``, boolean-mask indexing, ``unique``), and
    ``repeat_interleave`` without its output size. (``.tolist()`` and ``.cpu()`` of a CPU tensor do not
    reach the dispatcher; tests/test_no_host_sync.py reads the code for those.)"""

    SYNCING = {"aten::_local_scalar_dense", "aten::nonzero", "aten::masked_select", "aten::unique_dim",
               "aten::_unique2", "aten::unique_consecutive", "aten::is_nonzero", "aten::equal"}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = func._schema.name
        if name in self.SYNCING:
            raise AssertionError(f"{name} syncs with the host")
        if name in ("aten::index", "aten::index_put_", "aten::index_put") and any(
                isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in (args[1] or ())):
            raise AssertionError(f"{name} with a boolean mask syncs with the host")
        if name == "aten::repeat_interleave" and kwargs.get("output_size") is None and len(args) < 3:
            raise AssertionError("repeat_interleave without output_size syncs with the host")
        return func(*args, **kwargs)


def test_the_sync_check_catches_a_sync():
    with pytest.raises(AssertionError, match="_local_scalar_dense"), NoHostSync():
        torch.ones(2).sum().item()


def _use(model, lora, gpu_path: bool) -> None:
    model.attention = TritonAttention() if gpu_path else TorchAttention(model.windows)
    model.ops = TritonOps() if gpu_path else TorchOps()
    for layer in lora.layers.values():
        layer: LoRAProjection
        layer.backend = (TritonBackend if gpu_path else CpuBackend)(layer.backend.slots)


# What the families add to attention: Gemma 2's soft-capped scores and logits beside sliding and global
# layers (Gemma 3's second RoPE and q/k norms run before the backend, the same on both paths).
GEMMA = dict(query_pre_attn_scalar=24, sliding_window=5, layer_types=["sliding_attention", "full_attention"])
FAMILIES = {
    "llama": {},
    "gemma2": dict(GEMMA, architectures=["Gemma2ForCausalLM"], attn_logit_softcapping=1.5,
                   final_logit_softcapping=4.0, hidden_activation="gelu_pytorch_tanh"),
}


@pytest.mark.parametrize(("family", "graphs", "kv_fp8"), [("llama", False, False), ("llama", True, False),
                                                         ("gemma2", True, False), ("gemma2", True, True)])
def test_the_gpu_path_computes_what_the_cpu_path_computes_without_host_syncs(family, graphs, kv_fp8):
    model = tiny_model(hidden_size=64, **FAMILIES[family])  # head_dim 16, the kernels' smallest
    assert model.config.attn_softcap == FAMILIES[family].get("attn_logit_softcapping")
    if kv_fp8:  # --kv-cache-dtype fp8: both paths write and read the same e4m3 cache (scales 1/8 and 1/16)
        layers = model.config.num_layers
        model.use_kv_cache(KV_FP8, ((0.125,) * layers, (0.0625,) * layers))
    lora = tiny_lora(model)
    outputs = {}
    for gpu_path in (False, True):
        _use(model, lora, gpu_path)
        blocks = BlockManager(48, 4, 8, 16)
        runner = ModelRunner(model, lora, model.new_kv_cache(48, 4), blocks, 8, 64, graphs=graphs)
        seqs = [Sequence(f"s{i}", None, [(5 * i + j) % 97 for j in range(4 + 3 * i)], SamplingParams(), 64,
                         slot=slot) for i, slot in enumerate([-1, 0, 2, 1])]
        logits = []
        # step 1: two whole prompts and the first chunk of a third; step 2: decodes beside the rest of the
        # third and a fourth prompt; steps 3-4: decodes only (padded to a bucket with graphs)
        plan = [[(0, None), (1, None), (2, 5)], [(0, 1), (1, 1), (2, None), (3, None)],
                *[[(i, 1) for i in range(4)]] * 2]
        for step in plan:
            batch = []
            for i, n in step:
                seq = seqs[i]
                n = n or seq.num_uncomputed
                blocks.allocate(seq, n)
                batch.append(ScheduledSeq(seq, n))
            prepared = runner.prepare(batch)
            with torch.inference_mode(), NoHostSync() if gpu_path else contextlib.nullcontext():
                hidden = runner.step_runner.forward(prepared.inputs)
                rows = model.logits(hidden.index_select(0, prepared.inputs.sample_rows))
            logits.append(rows.clone())
            for item in batch:
                item.seq.num_computed += item.num_new
            sampled = [batch[k].seq for k in prepared.sampled_positions]
            for k, seq in enumerate(sampled):  # both paths continue with the CPU path's tokens
                seq.output_ids.append(int(outputs[False][len(logits) - 1][k].argmax()) if gpu_path
                                      else int(rows[k].argmax()))
        outputs[gpu_path] = logits
    for want, got in zip(outputs[False], outputs[True], strict=True):
        atol = logits_atol(longest_sum(model.config, rank=4, tokens=32), float(want.abs().max()))
        if kv_fp8:  # a key or value the paths compute a rounding apart may round to neighbouring e4m3 values
            atol += 1e-2 * float(want.abs().max())
        torch.testing.assert_close(got, want, rtol=0, atol=atol)
