"""Which of a pod's threads compute with torch, and on how many cores: the model thread on the pod's
compute threads, every other thread on one.

Why one team. torch's CPU kernels run on OpenMP (libgomp in the CPU wheels), which keeps a team of
worker threads for each thread that has run a parallel region, for the life of that thread. While
the teams' threads are no more than the CPUs, a team's workers spin between regions and the next op
starts at once; once they outnumber the CPUs, every worker sleeps after each region, and each small
op of a step waits for one to be woken. A step is hundreds of small ops (attention per sequence,
norms, LoRA tiles), so on a 2-core EPYC (demo model, torch 2.13, ``benchmarks/compute_threads.py``),
with the thread that loaded the model keeping its team of two beside the model thread's, a decode
step of 8 sequences took 59.9 ms against 36.2 ms with one team, and a step with an adapter's 24-token
prompt beside those decodes 1.57x the decodes alone against 1.25x.
"""

from __future__ import annotations

import asyncio
import os
from concurrent.futures import ThreadPoolExecutor

import torch


def available_cpus() -> int:
    """The CPUs this process may run on (its affinity mask, which a container's cpuset narrows, where the
    OS has one; else the machine's)."""
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1


def compute_here_on(threads: int) -> None:
    """The calling thread computes on ``threads`` torch threads for the rest of its life.

    torch gives a thread its count at the thread's first use of one (its first parallel op, or
    ``get_num_threads``), and gives it the count last set anywhere in the process, whatever the thread
    set before: a loop thread set to one took the model thread's two at its first step's inputs, and
    its team slowed every step as two teams do. So the count is taken first, then set."""
    torch.get_num_threads()
    torch.set_num_threads(threads)


def model_thread(compute_threads: int | None) -> ThreadPoolExecutor:
    """The one worker every step and start-up measurement runs on, computing on ``compute_threads``
    torch threads (None: the count torch gives a new thread, the last one set in this process)."""
    if compute_threads is None:
        return ThreadPoolExecutor(max_workers=1, thread_name_prefix="lorafleet-model")
    return ThreadPoolExecutor(max_workers=1, thread_name_prefix="lorafleet-model",
                              initializer=compute_here_on, initargs=(compute_threads,))


def compute_on_one_thread(loop: asyncio.AbstractEventLoop) -> None:
    """The calling thread (the event loop's: step inputs, sampling's outputs) and every thread of
    ``loop``'s default executor (the start-up load, adapter reads, grammar compiles) compute on one
    torch thread from now on, so that the model thread's team is the only one. Call it in the loop's
    thread before any of them has computed: a team, once started, lasts as long as its thread.

    Each of those threads sets its own count (``compute_here_on``): a thread that never sets one starts
    with the count last set anywhere in the process, which the model thread's is."""
    compute_here_on(1)
    loop.set_default_executor(ThreadPoolExecutor(thread_name_prefix="lorafleet-io",
                                                 initializer=compute_here_on, initargs=(1,)))
