"""benchmarks/lora_kernels.py needs a GPU to measure anything; without one it still parses its
arguments and says clearly why it stops."""

from __future__ import annotations

import importlib.util
import pathlib

import pytest
import torch

SCRIPT = pathlib.Path(__file__).resolve().parents[2] / "benchmarks" / "lora_kernels.py"


@pytest.fixture(scope="module")
def bench():
    spec = importlib.util.spec_from_file_location("lora_kernels_benchmark", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_arguments_parse_and_unknown_layers_are_refused(bench, capsys):
    args = bench.parse_args(["--layers", "qkv,down", "--ranks", "8", "--tokens", "1,4096", "--dtype", "fp16"])
    assert (args.layers, args.ranks, args.tokens, args.dtype) == (["qkv", "down"], [8], [1, 4096], "fp16")
    with pytest.raises(SystemExit):
        bench.parse_args(["--layers", "qkv,lm_head"])
    assert "unknown layers ['lm_head']" in capsys.readouterr().err


def test_without_cuda_it_exits_with_a_message_that_says_so(bench, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(SystemExit) as stopped:
        bench.main(["--ranks", "8"])
    assert "needs a CUDA GPU" in str(stopped.value.code)
