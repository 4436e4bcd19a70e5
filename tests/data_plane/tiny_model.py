"""A tiny random Llama built in-process (no checkpoint), with random adapters written straight into its
LoRA slots: for tests of the step machinery, where the weights' values do not matter but must not be zero."""

from __future__ import annotations

import torch

from data_plane.lora.layer import LoRAProjection
from data_plane.lora.peft_adapter import SliceDelta
from data_plane.lora.runtime import LoraRuntime
from data_plane.model.config import ModelConfig
from data_plane.model.llama import LlamaForCausalLM

TINY = dict(architectures=["LlamaForCausalLM"], vocab_size=97, hidden_size=32, intermediate_size=48,
            num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128)


def tiny_model(seed: int = 0, **overrides) -> LlamaForCausalLM:
    torch.manual_seed(seed)
    model = LlamaForCausalLM(ModelConfig.from_dict(TINY | overrides))
    for p in model.parameters():
        torch.nn.init.normal_(p, std=0.2)
    with torch.no_grad():
        for m in model.modules():
            if hasattr(m, "eps"):  # RMSNorm: weights near 1 keep activations in range
                m.weight.fill_(1.0)
    model.use_device("cpu")
    return model.eval()


def tiny_lora(model: LlamaForCausalLM, max_loras: int = 3, rank: int = 4, max_tokens: int = 256) -> LoraRuntime:
    """LoRA slots on ``model``, each slot holding a random adapter of ``rank`` on every projection."""
    runtime = LoraRuntime(model, max_loras, max_loras, rank, max_tokens, ())
    gen = torch.Generator().manual_seed(1)
    for layer in runtime.layers.values():
        layer: LoRAProjection
        offsets = layer.host_offsets
        for slot in range(max_loras):
            deltas = {name: SliceDelta(torch.randn(rank, layer.base.in_features, generator=gen) * 0.2,
                                       torch.randn(offsets[s + 1] - offsets[s], rank, generator=gen) * 0.2)
                      for s, name in enumerate(layer.slice_names)}
            layer.set_slot(slot, deltas)
    return runtime
