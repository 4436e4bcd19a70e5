"""The router as a real process in front of a real fleet on loopback (a redis-server, a control plane
and two CPU pods on the demo model, each holding a different pinned adapter): requests land where their
adapter lives, answers are the pods' own, and a dead pod's requests go elsewhere without an error."""

from __future__ import annotations

import signal
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest

from benchmarks.processes import PodProcess, RouterProcess
from tests.grpc_helpers import collect, request

pytestmark = pytest.mark.slow


def served(pod: PodProcess) -> float:
    """Generate requests the pod has finished, by its own counter."""
    return sum(float(line.rsplit(" ", 1)[1]) for line in pod.metrics().splitlines()
               if line.startswith("lorafleet_requests_total{"))


def through(router: RouterProcess, req, timeout: float = 120):
    text, tokens, last = "", [], None
    for last in router.generation().Generate(req, timeout=timeout):
        text += last.text
        tokens.extend(last.tokens)
    return text, tokens, last


def test_requests_for_each_adapter_land_on_the_pod_holding_it(stack):
    fleet, router, holders = stack
    for adapter, holder in holders.items():
        before = {name: served(pod) for name, pod in fleet.pods.items()}
        for i in range(3):
            _, _, last = through(router, request(f"Tell me about ship number {i}.", adapter, max_tokens=4))
            assert last.usage.completion_tokens > 0
        after = {name: served(pod) for name, pod in fleet.pods.items()}
        assert {name: after[name] - before[name] for name in after} == {
            name: (3 if pod is holder else 0) for name, pod in fleet.pods.items()}, adapter
    assert router.metric("lorafleet_router_routing_decisions_total", decision="device_hit") >= 6


def test_the_routers_answer_is_the_pods_own_for_the_same_greedy_request(stack):
    _, router, holders = stack
    for adapter in ("pirate", ""):
        req = request("Where is the treasure buried?", adapter, max_tokens=16, logprobs=2)
        direct_text, direct_tokens, direct_last = collect(holders["pirate"], req)
        text, tokens, last = through(router, req)
        assert text == direct_text and text
        assert [t.id for t in tokens] == [t.id for t in direct_tokens]
        assert len(tokens[0].top_logprobs) == 2
        assert (last.finish_reason, last.usage) == (direct_last.finish_reason, direct_last.usage)


def test_an_unregistered_adapter_is_not_found_and_no_pod_sees_it(stack):
    fleet, router, _ = stack
    before = {name: served(pod) for name, pod in fleet.pods.items()}
    with pytest.raises(grpc.RpcError) as e:
        through(router, request("Hi", "never-registered", max_tokens=4))
    assert e.value.code() == grpc.StatusCode.NOT_FOUND and "'never-registered' is not registered" in e.value.details()
    assert {name: served(pod) for name, pod in fleet.pods.items()} == before
    assert router.metric("lorafleet_router_requests_total", adapter_class="adapter", outcome="NOT_FOUND") == 1


def test_an_adapter_resident_nowhere_is_loaded_on_exactly_one_pod(stack):
    fleet, router, _ = stack
    with ThreadPoolExecutor(3) as pool:
        results = list(pool.map(lambda i: through(router, request(f"Say goodbye {i}.", "signoff", max_tokens=4)),
                                range(3)))
    assert all(last.usage.completion_tokens > 0 for _, _, last in results)
    holding = [name for name, pod in fleet.pods.items() if any(a.name == "signoff" for a in pod.state().adapters)]
    assert len(holding) == 1, holding
    assert router.metric("lorafleet_router_routing_decisions_total", decision="cold") == 1


def test_a_killed_pod_sends_new_requests_elsewhere_without_a_client_error(stack):
    fleet, router, holders = stack
    victim = holders["pirate"]
    victim.signal(signal.SIGKILL)
    victim.proc.wait(timeout=10)
    for adapter in ("pirate", "", "shouty", "pirate"):
        _, _, last = through(router, request("Are you still there?", adapter, max_tokens=4))
        assert last.usage.completion_tokens > 0, adapter
    assert router.metric("lorafleet_router_requests_total", adapter_class="adapter", outcome="UNAVAILABLE") == 0
