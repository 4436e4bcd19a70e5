"""Nothing in a forward pass waits on the device: the model, its attention backends, the LoRA layers,
the GPU LoRA backend, the fused layer ops, the step runners, the sampler, the model runner's step (prepared on
the loop from the persistent batch, then run: it starts the tokens' copy to the host and returns) and every
Triton launcher call no ``.item()``, ``.tolist()``, ``.cpu()``, ``.numpy()``, ``nonzero`` or synchronize. (A
CUDA graph could not capture such a call, and eagerly each one stalls the host until the GPU drains.)
tests/kernels/test_forward_on_gpu_path.py runs the same path under the Triton interpreter and fails on the
syncing ops the dispatcher sees."""

from __future__ import annotations

import ast
import pathlib

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
FORBIDDEN = {"item", "tolist", "cpu", "numpy", "nonzero", "synchronize", "argwhere", "masked_select"}
# file -> the functions (Class.method or function) on the forward path; "*" = every function in it
FORWARD_PATH = {
    "data_plane/model/llama.py": ["*"],
    "data_plane/model/rope.py": ["RotaryEmbedding.tables", "RotaryEmbedding.forward"],
    "data_plane/model/attention.py": ["*"],
    "data_plane/model/triton_attention.py": ["*"],
    "data_plane/model/layer_ops.py": ["*"],
    "data_plane/model/triton_layer_ops.py": ["*"],
    "data_plane/lora/layer.py": ["LoRAProjection.forward"],
    "kernels/lora_backend.py": ["TritonBackend.apply"],
    "kernels/lora_shrink.py": ["*"],
    "kernels/lora_expand.py": ["*"],
    "kernels/lora_launch.py": ["*"],
    "data_plane/engine/sampler.py": ["sample", "_allowed", "_draw", "_nucleus", "_gumbel", "_mix32_", "_top_ids",
                                     "Sampled.copy_to_host", "SamplingBatch.recounted"],
    # the step as the loop prepares it (each sequence's progress read on the host; a pending token gathered from
    # its row of the persistent batch's ids on the device) and as the model thread runs it: the forward,
    # sampling, the sampled ids kept at their rows on the device, and the tokens' copy to the host started, not
    # waited for (asynchronous scheduling)
    "data_plane/engine/model_runner.py": ["ModelRunner.prepare", "ModelRunner._fed", "ModelRunner.execute"],
    "data_plane/engine/step_inputs.py": ["StepInputBuilder.build", "StepInputBuilder.build_columns",
                                        "StepInputBuilder._decode_layout", "StepInputBuilder._mixed_layout",
                                        "StepInputBuilder._stage_appends"],
    "data_plane/engine/persistent_batch.py": ["*"],
    "data_plane/engine/step_runner.py": ["EagerRunner.forward", "GraphRunner.forward", "GraphRunner._bounded",
                                         "forward_batch"],
}
FORWARD_PATH |= {str(p.relative_to(ROOT)): ["*"] for p in ROOT.glob("kernels/*attention*.py")}
FORWARD_PATH |= {str(p.relative_to(ROOT)): ["*"] for p in ROOT.glob("kernels/fused_*.py")}


def _functions(tree: ast.Module):
    for node in tree.body:
        if isinstance(node, ast.FunctionDef):
            yield node.name, node
        elif isinstance(node, ast.ClassDef):
            for item in node.body:
                if isinstance(item, ast.FunctionDef):
                    yield f"{node.name}.{item.name}", item


def host_syncs(path: pathlib.Path, scope: list[str]) -> list[str]:
    """``name:line call`` of every forbidden call in the functions of ``scope``."""
    tree = ast.parse(path.read_text())
    found, names = [], set()
    for name, fn in _functions(tree):
        names.add(name)
        if "*" not in scope and name not in scope:
            continue
        for node in ast.walk(fn):
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr in FORBIDDEN:
                found.append(f"{name}:{node.lineno} .{node.func.attr}()")
    missing = [s for s in scope if s != "*" and s not in names]
    assert not missing, f"{path}: {missing} not found; update FORWARD_PATH"
    return found


@pytest.mark.parametrize("relative", sorted(FORWARD_PATH))
def test_the_forward_path_never_syncs_with_the_host(relative):
    assert host_syncs(ROOT / relative, FORWARD_PATH[relative]) == []


def test_the_check_finds_a_sync(tmp_path):
    code = ("class A:\n    def forward(self, x):\n        return x.sum().item()\n"
            "    def other(self, x):\n        x.tolist()\n")
    (tmp_path / "m.py").write_text(code)
    assert host_syncs(tmp_path / "m.py", ["A.forward"]) == ["A.forward:3 .item()"]
