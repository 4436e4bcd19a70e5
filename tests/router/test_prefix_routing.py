"""Prefix-aware routing: the router computes from a request's bytes the same routing-prefix chain the pod
computes from the parsed request, adapters never share a hash, and the score prefers a pod holding the
prompt's beginning among pods about as loaded, never one much busier."""

from __future__ import annotations

import pytest
from lorafleet.v1 import adapter_admin_pb2 as admin_pb
from lorafleet.v1 import data_plane_admin_pb2 as pod_pb
from lorafleet.v1 import generation_pb2 as gen_pb

from conventions.prefix_chain import CHUNK_BYTES, chain, input_bytes, routing_prefix
from router.errors import InvalidRequest
from router.request import RoutedRequest
from router.scoring import Weights, rank
from router.view import PodView, build_view

SYSTEM = "You are a careful assistant for the accounts team. " * 40  # ~2 KB: 8 chunks


def chat(adapter: str, *turns: tuple[str, str], tools: str = "") -> gen_pb.GenerateRequest:
    return gen_pb.GenerateRequest(adapter=adapter, tools_json=tools, messages=gen_pb.ChatMessages(
        messages=[gen_pb.ChatMessage(role=r, content=c) for r, c in turns]))


def test_the_router_computes_from_the_bytes_the_chain_the_pod_computes_from_the_request():
    requests = [chat("fin", ("system", SYSTEM), ("user", "What is an accrual? " * 30)),
                chat("fin", ("system", SYSTEM), ("user", "hi"), tools='[{"type": "function"}]'),
                gen_pb.GenerateRequest(adapter="", prompt="Once upon a time, " * 100),
                gen_pb.GenerateRequest(adapter="fin", prompt="héllo wörld ✓ " * 60)]
    for request in requests:
        pod_side = routing_prefix(request)
        assert pod_side.hashes and pod_side.input_bytes == len(input_bytes(request))
        routed = RoutedRequest.parse(request.SerializeToString())
        assert routed.prefix_chain() == pod_side.hashes
        # a router with tenants appends the tenant and its cache scope to the bytes it forwards: the pod computes
        # the same chain from what it receives, and it is the scope's own
        forwarded = routed.for_tenant("acme", "tenant:acme")
        assert forwarded.message == gen_pb.GenerateRequest.FromString(forwarded.payload)
        assert routing_prefix(forwarded.message).hashes == forwarded.prefix_chain()
        assert not set(forwarded.prefix_chain()) & set(pod_side.hashes)


def test_tenants_prompts_hash_apart_unless_they_share_a_group_and_a_callers_salt_splits_them_further():
    prompt = gen_pb.GenerateRequest(adapter="fin", prompt="Once upon a time, " * 100)
    routed = RoutedRequest.parse(prompt.SerializeToString())
    acme, globex = routed.for_tenant("acme", "tenant:acme"), routed.for_tenant("globex", "tenant:globex")
    assert not set(acme.prefix_chain()) & set(globex.prefix_chain())
    one, two = routed.for_tenant("acme", "group:holding"), routed.for_tenant("globex", "group:holding")
    assert one.prefix_chain() == two.prefix_chain() and (one.message.tenant, two.message.tenant) == ("acme", "globex")
    salted = RoutedRequest.of(gen_pb.GenerateRequest(adapter="fin", prompt=prompt.prompt, cache_salt="s1"))
    assert salted.for_tenant("acme", "tenant:acme").message.cache_salt == "tenant:acme/s1"
    assert not set(salted.for_tenant("acme", "tenant:acme").prefix_chain()) & set(acme.prefix_chain())
    # a caller that claims another tenant's scope in its own salt gets it under its own scope
    claimed = RoutedRequest.of(gen_pb.GenerateRequest(adapter="fin", prompt=prompt.prompt, cache_salt="tenant:acme"))
    assert claimed.for_tenant("globex", "tenant:globex").message.cache_salt == "tenant:globex/tenant:acme"
    assert claimed.for_open_door().message.cache_salt == "open/tenant:acme"  # nor can a caller no key names
    assert routed.for_open_door() is routed  # no salt, nothing to scope
    with pytest.raises(InvalidRequest, match="at most 256"):
        RoutedRequest.parse(gen_pb.GenerateRequest(prompt="x", cache_salt="s" * 257).SerializeToString())


def test_different_adapters_never_share_a_hash_for_the_same_input():
    data = input_bytes(chat("", ("system", SYSTEM), ("user", "hello")))
    chains = [chain(name, data) for name in ("", "fin", "legal", "fin2", "fi")]
    assert all(len(c) == len(chains[0]) > 0 for c in chains)
    assert len({h for c in chains for h in c}) == sum(map(len, chains))


def test_requests_share_exactly_the_hashes_of_the_chunks_their_inputs_share():
    a = routing_prefix(chat("fin", ("system", SYSTEM), ("user", "Explain deferred revenue, please. " * 20)))
    b = routing_prefix(chat("fin", ("system", SYSTEM), ("user", "Draft a memo on the audit. " * 20)))
    shared = next(i for i, (x, y) in enumerate(zip(input_bytes(chat("fin", ("system", SYSTEM), ("user", "E"))),
                                                   input_bytes(chat("fin", ("system", SYSTEM), ("user", "D"))),
                                                   strict=False)) if x != y)
    assert a.hashes[: shared // CHUNK_BYTES] == b.hashes[: shared // CHUNK_BYTES]
    assert not set(a.hashes[shared // CHUNK_BYTES :]) & set(b.hashes)


def test_a_prompt_and_messages_of_the_same_text_do_not_match_and_a_short_input_has_no_chain():
    text = "x" * 4 * CHUNK_BYTES
    assert not set(routing_prefix(gen_pb.GenerateRequest(prompt=text)).hashes) & set(
        routing_prefix(chat("", ("user", text))).hashes)
    assert routing_prefix(gen_pb.GenerateRequest(prompt="short")).hashes == ()
    with pytest.raises(InvalidRequest, match="not a lorafleet.v1.GenerateRequest"):
        RoutedRequest.parse(b"\xff\xff not a request")


def pod(pod_id: str, held: tuple[int, ...] = (), running: int = 0, waiting: int = 0) -> PodView:
    return PodView(pod_id, f"{pod_id}:1", slots_total=4, running=running, waiting=waiting, prefixes=frozenset(held))


HASHES = routing_prefix(chat("", ("system", SYSTEM), ("user", "Summarise the ledger. " * 40))).hashes


def test_a_pod_holding_the_prefix_wins_when_loads_are_comparable():
    assert len(HASHES) >= 8
    holder, other = pod("z-holder", HASHES[:6], running=3), pod("a-other", running=2)  # one request apart
    ranked = rank("", [holder, other], chain=HASHES)
    assert ranked[0].pod.id == "z-holder" and ranked[0].matched == 6 and ranked[1].matched == 0
    # the longer the prefix held, the better; the last reported hash counts the chunks before it
    longer = pod("y-longer", (HASHES[7],), running=3)
    assert [c.pod.id for c in rank("", [holder, other, longer], chain=HASHES)] == ["y-longer", "z-holder", "a-other"]


def test_load_still_dominates_when_the_pod_holding_the_prefix_is_overloaded():
    # a pod holding the whole prompt but a few more requests than the prefix weighs loses to an idle one
    holder, idle = pod("holder", HASHES, running=int(Weights().prefix) + 2, waiting=1), pod("idle")
    assert rank("", [holder, idle], chain=HASHES)[0].pod.id == "idle"
    # and with the prefix weight at 0 the score is blind to prefixes: the less loaded pod wins by one request
    blind = rank("", [pod("holder", HASHES, running=1), pod("other")], Weights(prefix=0.0), chain=HASHES)
    assert blind[0].pod.id == "other" and blind[0].matched == 0


def test_the_view_reads_each_pods_reported_hashes():
    state = pod_pb.PodState(slots=pod_pb.TierUsage(capacity=4), prefix_hashes=[HASHES[0], HASHES[3]])
    view = build_view([], [admin_pb.Pod(id="p", endpoint="p:1", ready=True)], {"p": state}, 0.0)
    assert view.pods[0].prefixes == {HASHES[0], HASHES[3]}
    assert view.pods[0].matched(HASHES) == 4
