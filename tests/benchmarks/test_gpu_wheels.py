"""benchmarks/gpu_wheels.py finds what gpu.py imports, into function bodies and CUDA-only branches, and
reads a wheel's requirements as they hold on the GPU image's Python."""

from __future__ import annotations

import zipfile

from benchmarks import gpu_wheels


def test_the_import_walk_finds_the_third_party_modules_gpu_py_reaches():
    found = gpu_wheels.third_party_modules()
    # jinja2 and tokenizers through the pod's tokenizer; triton through the CUDA-only LoRA and attention
    # kernels; transformers and peft imported inside gpu_reference's functions
    assert {"torch", "triton", "tokenizers", "jinja2", "transformers", "peft", "safetensors"} <= found
    # the generated protos (protos/lorafleet) are the project's own, not a wheel to download
    assert not found & {"data_plane", "kernels", "tests", "gpu_pods", "synthetic", "asyncio", "json", "lorafleet"}
    assert gpu_wheels.distributions(found) >= {"torch", "tokenizers", "jinja2"}


def test_wheel_requirements_follow_markers_for_python_3_12_and_leave_extras_out(tmp_path):
    wheel = tmp_path / "demo-1.0-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w") as z:
        z.writestr("demo-1.0.dist-info/METADATA", "\n".join([
            "Metadata-Version: 2.1", "Name: demo", "Version: 1.0",
            "Requires-Dist: numpy>=2",
            'Requires-Dist: tomli; python_version < "3.11"',
            'Requires-Dist: Typing_Extensions; python_version >= "3.12"',
            'Requires-Dist: pywin32; sys_platform == "win32"',
            'Requires-Dist: pytest; extra == "test"',
        ]))
    assert gpu_wheels.wheel_requirements(wheel) == {"numpy", "typing-extensions"}


def test_every_manylinux_tag_the_image_runs_is_asked_for():
    """pip matches a manylinux tag exactly: a wheel tagged manylinux_2_31 (llguidance's) is found only when
    that tag is named."""
    assert {f"manylinux_2_{n}_x86_64" for n in range(17, 40)} <= set(gpu_wheels.PLATFORMS)
