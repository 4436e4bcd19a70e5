"""Prefix-aware routing with real processes (the router tests' fleet: two CPU pods on the demo model and a
router): a pod lists the routing prefix of a prompt it prefilled in GetState, and the router sends a later
request that begins with the same system prompt to that pod, although with both pods idle the tie between
them would go to the other (the lower pod id)."""

from __future__ import annotations

import time

import pytest

from benchmarks.processes import wait_until
from conventions.prefix_chain import routing_prefix
from tests.grpc_helpers import collect, request

pytestmark = pytest.mark.slow
HIT_TOKENS = "lorafleet_prefix_cache_hit_tokens_total"
DECISIONS = "lorafleet_router_prefix_decisions_total"


def chat(system: str, user: str):
    req = request(user, max_tokens=2)
    req.messages.messages.insert(0, type(req.messages.messages[0])(role="system", content=system))
    return req


def test_the_router_sends_a_prompt_to_the_pod_that_reports_holding_its_beginning(stack):
    fleet, router, _ = stack
    first, last = (fleet.pods[pod_id] for pod_id in sorted(fleet.pods))
    # The router reads the pods every 0.3 s; a request it routes before it has read the holder's report goes
    # by the tie to the first pod. Each attempt uses a system prompt no pod has seen, so a stale read only
    # costs a retry, never a false pass.
    for attempt in range(5):
        system = (f"Attempt {attempt}. You answer questions about the harbour of Bergen for visiting sailors; "
                  "keep to the tide tables, the berths and the fees, and say so when you do not know. ") * 8
        warm = chat(system, "Where can I berth a 12 metre boat?")
        collect(last, warm)  # straight to the pod the tie does not favour
        hashes = routing_prefix(warm).hashes
        wait_until(lambda h=hashes: set(h[:4]) <= set(last.state().prefix_hashes), 30,
                   "the pod listing the prompt's routing prefix")
        assert not set(hashes) & set(first.state().prefix_hashes)
        time.sleep(1.0)  # a few of the router's reads
        held_before = router.metric(DECISIONS, held="part") + router.metric(DECISIONS, held="all")
        none_before = router.metric(DECISIONS, held="none")
        hits = (first.metric(HIT_TOKENS), last.metric(HIT_TOKENS))
        collect(router, chat(system, "What does a night in the guest harbour cost?"))
        if router.metric(DECISIONS, held="none") > none_before:
            continue  # routed on a view read before the report: try again with a fresh prompt
        assert router.metric(DECISIONS, held="part") + router.metric(DECISIONS, held="all") == held_before + 1
        assert last.metric(HIT_TOKENS) - hits[1] >= 4 * 16  # it found the system prompt's blocks cached
        assert first.metric(HIT_TOKENS) == hits[0]
        return
    pytest.fail("the router never routed on a view that held the pod's report")
