"""What a request would wait for on a pod, in units of "one request already running": the one cost that
both the router (to route a request) and the control plane (to place an adapter's extra replica) rank
pods by, so that a replica goes where the router would have sent the adapter's overflow anyway."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Weights:
    """Costs in units of one running request. A CPU-to-slot copy takes milliseconds. A cold load costs
    more than its read: the adapter takes a slot and a CPU entry for as long as its requests run, the
    copy it makes duplicates one held elsewhere, and an eviction makes the evicted adapter's next request
    cold. The fleet simulator (benchmarks/fleet_sim.py, 100 pods x 10,000 adapters) showed it: with
    free_slot/evict at 4/6 the router spread adapters too eagerly, and at 14/20 it made fewer cold loads
    with queueing p99 no worse (benchmarks/RESULTS.md, "Fleet simulation"). A waiting request costs more
    than a running one because it means the pod's batch is full, and a nearly full KV cache means
    preemptions."""

    cpu_hit: float = 0.5
    free_slot: float = 14.0
    evict: float = 20.0
    # An adapter not in a slot, on a pod whose every slot holds a pinned or serving adapter, waits for one of
    # them to finish its requests before its first step: longer than a load. The fleet simulator traced the
    # queue p99 of zipf 0.8 and of 1.5x the rate to CPU hits on such pods (charged 0.5): at 50 pods x 5,000
    # adapters, 40 took those p99s from 2.2 s and 3.3 s to 1.5 s and 1.7 s for 2% more cold loads (14: 2.0
    # and 2.4 s; 60: 1.0 and 1.6 s for 40-70% more; benchmarks/RESULTS.md, "Fleet simulation: a wait for a
    # slot").
    slot_wait: float = 40.0
    running: float = 1.0
    waiting: float = 2.0
    kv_usage: float = 4.0
    # What a pod that holds none of a request's prompt costs more than one that holds all of it (in
    # proportion between): the prefill it must redo. 0 routes blind to prefixes. The fleet simulator's chat
    # workload (benchmarks/prefix_routing.py: 1,024-token system prompts, twice as many as one pod's KV cache
    # holds) found 10 taking the cached share of prompt tokens from 36% to 77% and TTFT p50 from 2.2 s to
    # 37 ms, with load as even as before; at 40 a pod holding a prompt drew too much and TTFT p99 grew.
    prefix: float = 10.0

    def __post_init__(self) -> None:
        if min(vars(self).values()) < 0:
            raise ValueError(f"routing weights must not be negative: {self}")

    def load(self, running: int, waiting: int, kv_usage: float) -> float:
        """The cost of a pod's load: its running and waiting requests and its KV-cache usage (0..1)."""
        return self.running * running + self.waiting * waiting + self.kv_usage * kv_usage

    def prefill(self, matched: int, chunks: int) -> float:
        """The cost of the part of a prompt of ``chunks`` routing-prefix chunks a pod does not hold, when it
        holds the first ``matched`` of them."""
        return self.prefix * (chunks - matched) / chunks if chunks else 0.0

    def cold(self, has_free_slot: bool) -> float:
        """The cost of an adapter a pod does not hold: a read into a free slot, or that plus an eviction."""
        return self.free_slot if has_free_slot else self.evict
