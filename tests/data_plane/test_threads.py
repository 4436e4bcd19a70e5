"""A pod's torch threads: the model thread computes on the pod's compute threads, and every other
thread (the event loop's, its default executor's) on one, so that only one OpenMP team exists."""

from __future__ import annotations

import asyncio
import threading

import torch

from data_plane.engine.threads import compute_on_one_thread, model_thread


def _in_a_fresh_thread(fn):
    """``fn()``'s result, run on a new thread: the counts it sets stay off the test runner's thread."""
    result = {}
    worker = threading.Thread(target=lambda: result.setdefault("value", fn()))
    worker.start()
    worker.join(timeout=60)
    return result["value"]


def test_only_the_model_thread_computes_on_several_threads():
    before = torch.get_num_threads()

    async def threads_seen() -> tuple[int, int, int]:
        compute_on_one_thread(asyncio.get_running_loop())
        model = model_thread(3)
        try:
            on_model = model.submit(torch.get_num_threads).result()
            # The model thread set 3 last, which torch gives a thread at its first use of a count: the loop
            # thread's first use comes now, and a thread the executor starts now has never used one.
            on_loop = torch.get_num_threads()
            on_executor = await asyncio.to_thread(torch.get_num_threads)
        finally:
            model.shutdown()
        return on_loop, on_executor, on_model

    try:
        assert _in_a_fresh_thread(lambda: asyncio.run(threads_seen())) == (1, 1, 3)
    finally:
        torch.set_num_threads(before)  # the process-wide count new threads start with

