"""A chat workload with shared system prompts on pods with finite KV caches: does routing by the pods'
reported prefixes pay? The router is the real PodPicker (router/picker.py) over a view refreshed every
``view_interval_s``, as the refresher reads it; each pod's KV cache is the real BlockManager with prefix
caching, and what it reports is the real PrefixReport of the real routing-prefix chains of real
GenerateRequests. Only time is modelled.

A pod runs steps back to back while it has work: each step decodes one token of every request past its
prefill and prefills up to ``prefill_budget`` prompt tokens that are not cached, first come first served,
and takes ``base_s + per_seq_s * rows + per_prefill_token_s * prefilled tokens``. A waiting request is
admitted in arrival order once a seat (``max_num_seqs``) and the KV blocks of its whole prompt and answer
are free (so nothing is preempted); its cached prefix is matched then, and its prompt's full blocks are
cached once its prefill ends, when its first token is out. Every adapter is resident on every pod: only
prefixes tell the pods apart.
"""

from __future__ import annotations

import heapq
import itertools
from collections import deque
from dataclasses import dataclass, field

import numpy as np
from lorafleet.v1 import generation_pb2 as gen_pb

from conventions.pod_cost import Weights
from conventions.prefix_chain import RoutingPrefix, routing_prefix
from data_plane.config import DataPlaneConfig
from data_plane.engine.block_manager import BlockManager
from data_plane.engine.prefix_report import PrefixReport
from data_plane.engine.sequence import SamplingParams, Sequence
from fleetsim.config import shipped
from router.config import RouterConfig
from router.picker import PodPicker
from router.view import FleetView, PodView, Tier

_WORDS = 40_000  # a prompt token is one word "wNNNNN " of the text: 7 input bytes a token


@dataclass(frozen=True)
class PrefixWorkload:
    """``adapters`` x ``system_prompts`` distinct system prompts of ``system_tokens`` tokens each, chosen by
    Zipf popularity (``alpha``; 0 = uniform) per request, then a unique user turn and an answer."""

    adapters: int = 4
    system_prompts: int = 16
    system_tokens: int = 1024
    user_tokens: tuple[int, int] = (64, 256)
    output_tokens: tuple[int, int] = (32, 256)
    alpha: float = 0.0
    rate: float = 40.0  # requests per second, Poisson
    duration_s: float = 120.0
    warmup_s: float = 30.0  # arrivals before this are not counted
    seed: int = 0


@dataclass(frozen=True)
class PrefixFleet:
    """The pods: ``num_kv_blocks`` of ``block_size`` tokens each; the step model's costs are assumptions for
    an 8B model on one H100 (10 ms + 0.25 ms a sequence, plus ~14k prefill tokens a second), the fleet
    simulator's before its StepModel was fitted to the H100 run (fleetsim/config.py: 9.57 ms + 0.069 ms a
    sequence), kept so that benchmarks/RESULTS.md's "Prefix-aware routing" figures reproduce."""

    pods: int = 8
    max_num_seqs: int = 32
    num_kv_blocks: int = 4096
    block_size: int = shipped(DataPlaneConfig, "block_size")
    prefill_budget: int = 2048
    base_s: float = 0.010
    per_seq_s: float = 0.00025
    per_prefill_token_s: float = 0.00007
    view_interval_s: float = shipped(RouterConfig, "refresh_interval")
    report_size: int = shipped(DataPlaneConfig, "prefix_report_size")


@dataclass(frozen=True)
class PrefixResult:
    prefix_weight: float
    requests: int
    completed: int
    hit_rate: float  # prompt tokens found cached / prompt tokens, of the requests counted
    prefill_tokens_per_request: float  # prompt tokens computed, mean
    ttft_p50_ms: float
    ttft_p99_ms: float
    e2e_p50_ms: float
    imbalance: float  # max / mean of requests per pod
    routed_to_holder: float  # share of requests sent to a pod that reported holding part of their prefix


@dataclass
class _Request:
    rid: int
    arrival: float
    prompt: list[int]
    output: int
    routing: RoutingPrefix
    seq: Sequence | None = None
    prefilled: int = 0  # prompt tokens computed or found cached
    cached: int = 0
    decoded: int = 0
    first_token: float | None = None
    done: float | None = None


@dataclass
class _Pod:
    id: str
    blocks: BlockManager
    report: PrefixReport
    waiting: deque = field(default_factory=deque)
    running: list = field(default_factory=list)
    busy: bool = False
    served: int = 0


def make_requests(w: PrefixWorkload) -> list[_Request]:
    """The workload's requests, in arrival order; seeded."""
    rng = np.random.default_rng(w.seed)
    systems = [rng.integers(_WORDS, size=w.system_tokens).tolist() for _ in range(w.adapters * w.system_prompts)]
    ranks = np.arange(1, len(systems) + 1, dtype=np.float64) ** -w.alpha
    times = np.sort(rng.uniform(0, w.duration_s, rng.poisson(w.rate * w.duration_s)))
    which = rng.permutation(len(systems))[rng.choice(len(systems), size=len(times), p=ranks / ranks.sum())]
    out = []
    for rid, (at, s) in enumerate(zip(times, which, strict=True)):
        user = rng.integers(_WORDS, size=int(rng.integers(*w.user_tokens, endpoint=True))).tolist()
        adapter = f"adapter-{s // w.system_prompts}"
        request = gen_pb.GenerateRequest(adapter=adapter, messages=gen_pb.ChatMessages(messages=[
            gen_pb.ChatMessage(role="system", content=_text(systems[s])),
            gen_pb.ChatMessage(role="user", content=_text(user))]))
        # the adapter in the prompt's tokens stands for the pod's salt: blocks never match across adapters
        prompt = [int(s // w.system_prompts) + _WORDS, *systems[s], *user]
        out.append(_Request(rid, float(at), prompt, int(rng.integers(*w.output_tokens, endpoint=True)),
                            routing_prefix(request)))
    return out


def _text(tokens: list[int]) -> str:
    return "".join(f"w{t:05d} " for t in tokens)


class PrefixSimulation:
    """One prefix weight (0: today's scoring, blind to prefixes) on one workload; seeded, so every weight
    sees the same requests."""

    def __init__(self, fleet: PrefixFleet, workload: PrefixWorkload, prefix_weight: float,
                 requests: list[_Request] | None = None) -> None:
        self.fleet, self.workload, self.weight = fleet, workload, prefix_weight
        self.requests = requests if requests is not None else make_requests(workload)
        self.pods = []
        for i in range(fleet.pods):
            blocks = BlockManager(fleet.num_kv_blocks, fleet.block_size, fleet.max_num_seqs, prefix_caching=True)
            self.pods.append(_Pod(f"pod-{i:02d}", blocks, PrefixReport(blocks.prefix, fleet.report_size)))
        self.now = 0.0
        self._adapters = frozenset(f"adapter-{a}" for a in range(workload.adapters))
        self._view = self._read_view()
        self._picker = PodPicker(lambda: self._view, Weights(prefix=prefix_weight), clock=lambda: self.now)
        self._heap: list[tuple[float, int, int]] = []  # (time, order, pod index: a step ends; -1: view read)
        self._order = itertools.count()
        self._routed_to_holder = 0

    def run(self) -> PrefixResult:
        heapq.heappush(self._heap, (self.fleet.view_interval_s, next(self._order), -1))
        pending = len(self.requests)
        arrivals = iter(self.requests)
        nxt = next(arrivals, None)
        while pending:
            if nxt is not None and (not self._heap or nxt.arrival <= self._heap[0][0]):
                self.now = nxt.arrival
                self._arrive(nxt)
                nxt = next(arrivals, None)
                continue
            self.now, _, index = heapq.heappop(self._heap)
            if index < 0:
                self._view = self._read_view()
                heapq.heappush(self._heap, (self.now + self.fleet.view_interval_s, next(self._order), -1))
            else:
                pending -= self._step_done(index)
        return self._result()

    def _read_view(self) -> FleetView:
        residency = dict.fromkeys(self._adapters, Tier.DEVICE)
        return FleetView(self._adapters, tuple(
            PodView(p.id, f"{p.id}:1", slots_total=len(residency), slots_used=len(residency), residency=residency,
                    running=len(p.running), waiting=len(p.waiting), kv_usage=p.blocks.usage,
                    prefixes=frozenset(p.report.held()))
            for p in self.pods), self.now)

    def _arrive(self, r: _Request) -> None:
        adapter = f"adapter-{r.prompt[0] - _WORDS}"
        choice = self._picker.choose(adapter, r.routing.hashes)[0]
        if r.arrival >= self.workload.warmup_s:
            self._routed_to_holder += choice.matched > 0
        index = int(choice.pod.id.removeprefix("pod-"))
        pod = self.pods[index]
        self._picker.started(pod.id, adapter)
        pod.served += r.arrival >= self.workload.warmup_s
        pod.waiting.append(r)
        if not pod.busy:
            self._start_step(index)

    def _start_step(self, index: int) -> None:
        """Admits what fits, then runs one step on the pod if it has work; the step ends at its event."""
        pod, fleet = self.pods[index], self.fleet
        while pod.waiting and len(pod.running) < fleet.max_num_seqs:
            r = pod.waiting[0]
            seq = Sequence(str(r.rid), None, r.prompt, SamplingParams(), len(r.prompt) + r.output)
            r.cached = pod.blocks.match_prefix(seq, "")
            if not pod.blocks.can_allocate(seq, len(r.prompt) + r.output - r.cached):
                pod.blocks.free(seq)
                break
            pod.blocks.allocate(seq, len(r.prompt) + r.output - r.cached)
            r.seq, r.prefilled = seq, r.cached
            pod.running.append(pod.waiting.popleft())
        if not pod.running:
            pod.busy = False
            return
        budget, prefill, rows = fleet.prefill_budget, 0, 0
        for r in pod.running:
            if r.prefilled < len(r.prompt):
                take = min(budget, len(r.prompt) - r.prefilled)
                r.prefilled += take
                budget -= take
                prefill += take
            else:
                rows += 1
        pod.busy = True
        took = fleet.base_s + fleet.per_seq_s * (rows + (prefill > 0)) + fleet.per_prefill_token_s * prefill
        heapq.heappush(self._heap, (self.now + took, next(self._order), index))

    def _step_done(self, index: int) -> int:
        """The pod's step ended: first tokens and decoded tokens out, finished requests freed; the next step
        starts. Returns how many requests finished."""
        pod, finished = self.pods[index], 0
        for r in list(pod.running):
            if r.first_token is None:
                if r.prefilled < len(r.prompt):
                    continue
                r.first_token = self.now  # the prefill's last chunk samples the first token
                r.seq.num_computed = len(r.prompt)
                pod.blocks.cache_full_blocks(r.seq)
                cached = pod.blocks.prefix.match("", r.prompt, len(r.prompt))
                pod.report.record(r.routing, len(r.prompt), [content for content, _ in cached])
            r.decoded += 1
            if r.decoded >= r.output:
                pod.running.remove(r)
                pod.blocks.free(r.seq)
                self._picker.finished(pod.id)
                finished += 1
                r.seq, r.done = None, self.now
        self._start_step(index)
        return finished

    def _result(self) -> PrefixResult:
        counted = [r for r in self.requests if r.arrival >= self.workload.warmup_s]
        prompt = sum(len(r.prompt) for r in counted)
        ttft = np.array([r.first_token - r.arrival for r in counted]) * 1000
        served = np.array([p.served for p in self.pods], dtype=np.float64)
        return PrefixResult(
            prefix_weight=self.weight, requests=len(counted), completed=sum(r.decoded >= r.output for r in counted),
            hit_rate=sum(r.cached for r in counted) / prompt,
            prefill_tokens_per_request=(prompt - sum(r.cached for r in counted)) / len(counted),
            ttft_p50_ms=float(np.percentile(ttft, 50)), ttft_p99_ms=float(np.percentile(ttft, 99)),
            e2e_p50_ms=float(np.percentile([r.done - r.arrival for r in counted], 50)) * 1000,
            imbalance=float(served.max() / served.mean()), routed_to_holder=self._routed_to_holder / len(counted))
