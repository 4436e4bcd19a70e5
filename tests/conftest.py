"""Shared fixtures: the demo model (fetched and converted once per machine) and its tokenizer."""

from __future__ import annotations

import os

import pytest

# Parity tests compare float32 results; keep both implementations on the same thread count.
os.environ.setdefault("OMP_NUM_THREADS", "2")
# Pods started by tests share the machine's cores with each other and with this process. A pod's one
# OpenMP team spins between parallel regions (data_plane/engine/threads.py), which is what a pod alone
# on its cores wants; two pods computing at once on 2 cores then spin against each other's descheduled
# threads, and warming up together took minutes instead of seconds. Here their workers sleep at once.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

# Fixtures that load the demo model or start a child process. A test that uses one, directly or
# through another fixture, is marked slow, so that `-m "not slow"` leaves it out; a test that starts
# a process itself carries @pytest.mark.slow.
SLOW_FIXTURES = {
    "demo_model_dir": "fetches and loads the demo model",
    "redis_server": "starts a redis-server",
    "tls_files": "runs openssl",
}


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        if SLOW_FIXTURES.keys() & set(getattr(item, "fixturenames", ())):
            item.add_marker(pytest.mark.slow)


@pytest.fixture(scope="session")
def demo_model_dir():
    from data_plane.model.demo_model import ensure_demo_model

    return ensure_demo_model(quiet=True)


@pytest.fixture(scope="session")
def demo_model(demo_model_dir):
    from data_plane.model import load_model

    return load_model(demo_model_dir, "float32")


@pytest.fixture(scope="session")
def demo_tokenizer(demo_model_dir):
    from data_plane.model.tokenizer import Tokenizer

    return Tokenizer(demo_model_dir)


@pytest.fixture(scope="session")
def hf_demo_model(demo_model_dir):
    import torch
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(demo_model_dir, dtype=torch.float32).eval()
