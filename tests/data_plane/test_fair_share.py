"""Fair shares weigh accounts, not adapters: a tenant's requests share one counter whatever adapters they
name, so a tenant flooding several adapters gets one turn for each turn of a tenant on one adapter; a
request without a tenant is its adapter's own account, as before tenants existed."""

from __future__ import annotations

import pytest

from data_plane.engine.fair_share import FairShare
from data_plane.engine.sequence import SamplingParams, Sequence
from tests.data_plane.test_scheduler import admission_order, scheduler, step


def flood_and_trickle(tenants: bool) -> list[str]:
    """One seat; tenant "big" queues 4 one-token requests on each of a, b and c, then tenant "small" 4 on d;
    the order in which they run."""
    s = scheduler(max_num_seqs=1, max_loras=4, adapters="abcd")
    for i in range(4):
        for adapter in "abc":
            seq = Sequence(f"big-{adapter}{i}", adapter, list(range(4)), SamplingParams(max_tokens=1), 5)
            seq.tenant = "big" if tenants else None
            s.add(seq)
    for i in range(4):
        seq = Sequence(f"small-d{i}", "d", list(range(4)), SamplingParams(max_tokens=1), 5)
        seq.tenant = "small" if tenants else None
        s.add(seq)
    return admission_order(s)


def test_a_tenant_flooding_three_adapters_gets_one_turn_per_turn_of_a_tenant_on_one():
    order = flood_and_trickle(tenants=True)
    assert len(order) == 16
    # Every second request is small's until small has none left: 4 of the first 8.
    assert [name.split("-")[0] for name in order[:8]].count("small") == 4
    assert all(order[i].startswith("small") != order[i + 1].startswith("small") for i in range(7))


def test_without_tenants_each_adapter_is_its_own_share():
    order = flood_and_trickle(tenants=False)
    # Four accounts (a, b, c, d): small's adapter d gets one turn in four.
    assert [name.split("-")[0] for name in order[:8]].count("small") == 2


def test_a_tenant_is_charged_once_whatever_adapter_and_a_flow_ranks_by_its_least_served_account():
    shares = FairShare({"a": 2.0})
    shares.join("a", "big"), shares.join("b", "big"), shares.join("b", "small")
    shares.charge("a", 10, "big")  # 10 tokens at weight 2: 5
    shares.charge("b", 4, "big")
    assert shares.served("a") == 9.0  # big's one counter
    assert shares.served("b") == 0.0  # small, also waiting on b, has had nothing yet
    shares.leave("b", "small")
    assert shares.served("b") == 9.0
    shares.join("c")  # no tenant: its own account, starting at the floor (big's 9, the least served)
    assert shares.served("c") == 9.0


def seats_after_a_trickle_arrives(tenants: bool) -> list[str]:
    """Four seats held by tenant "big", one request on each of four adapters; tenant "small" then queues one
    on a fifth adapter: who runs at the next step."""
    s = scheduler(max_num_seqs=4, max_loras=5, adapters="abcde")
    for adapter in "abcd":
        seq = Sequence(f"big-{adapter}", adapter, list(range(4)), SamplingParams(max_tokens=50), 54)
        seq.tenant = "big" if tenants else None
        s.add(seq)
    step(s)
    small = Sequence("small-e", "e", list(range(4)), SamplingParams(max_tokens=1), 5)
    small.tenant = "small" if tenants else None
    s.add(small)
    return sorted(name for name, _ in step(s))


def test_a_tenant_without_a_seat_takes_one_from_a_tenant_whose_seats_are_spread_over_adapters():
    assert seats_after_a_trickle_arrives(tenants=True) == ["big-a", "big-b", "big-c", "small-e"]
    # Per adapter, each of a-d holds one seat only, and none gives it up: small waits for one to finish.
    assert seats_after_a_trickle_arrives(tenants=False) == ["big-a", "big-b", "big-c", "big-d"]


def test_the_admission_estimate_knows_a_new_tenant_takes_a_seat_from_a_tenant_whose_seats_are_spread():
    s = scheduler(max_num_seqs=4, max_loras=5, adapters="abcde")
    for adapter in "abcd":
        seq = Sequence(f"big-{adapter}", adapter, list(range(4)), SamplingParams(max_tokens=50), 54)
        seq.tenant = "big"
        s.add(seq)
    step(s)
    # big holds all four seats, one per adapter: the plan of the queue gives a request of small one at once
    # (as ``step`` then does), its first token at the next step, and so one with no tenant (its own account,
    # e's flow, holds none); one of big's own waits for one to turn over
    assert s.plan().landing("e", "small", 4).steps == 1
    assert s.plan().landing("e", None, 4).steps == 1
    assert s.plan().landing("e", "big", 4).steps > 1


def quiet_request_beside_a_flood_on_three_adapters(tenants: bool) -> dict:
    """A flood request on a served its 4-token prompt; then three 5-token flood requests queued on each of a,
    b and c (tenant "big", or no tenant), each ending at its first token; where the plan lands a 7-token
    request on d (tenant "small", or none): the prompt tokens of others computed by its first token, per
    adapter. Steps of 12 tokens, seats to spare, without the join credit: the shares alone."""
    s = scheduler(max_num_seqs=16, budget=12, num_blocks=256, max_loras=4, adapters="abcd", join_credit=0)

    def add(name: str, adapter: str, n: int) -> None:
        seq = Sequence(name, adapter, list(range(n)), SamplingParams(max_tokens=1), n + 1)
        seq.tenant = "big" if tenants else None
        s.add(seq)

    add("running", "a", 4)
    step(s)
    for adapter in "abc":
        for i in range(3):
            add(f"{adapter}{i}", adapter, 5)
    landing = s.plan().landing("d", "small" if tenants else None, 7)
    assert landing.followed
    return dict(landing.by_flow)


def test_the_admission_estimate_counts_a_tenant_s_share_once_whatever_its_adapters():
    # where big's three adapters share one counter, the quiet request's first token comes in the first step,
    # beside one of the flood's prompts; where each adapter is its own share, in the second, after one prompt
    # of each of a, b and c (its step carries 2 tokens of a's next after it)
    assert quiet_request_beside_a_flood_on_three_adapters(tenants=True) == {"a": 5}
    assert quiet_request_beside_a_flood_on_three_adapters(tenants=False) == {"a": 7, "b": 5, "c": 5}


def test_the_admission_estimate_counts_a_tenant_s_work_on_its_other_adapters_as_its_own():
    s = scheduler(max_num_seqs=16, budget=32, num_blocks=256, max_loras=4, adapters="abcd", join_credit=0)
    for name, adapter, tenant, tokens in (("running", "a", "big", 5), ("big-b", "b", "big", 300),
                                          ("small-c", "c", "small", 5)):
        seq = Sequence(name, adapter, list(range(tokens)), SamplingParams(max_tokens=1), tokens + 1)
        seq.tenant = tenant
        s.add(seq)
        if name == "running":
            step(s)  # big's counter: 5, where small joins
    # a new 7-token request of big on d: big's 300 tokens queued on b are its own, all ahead of it, and
    # small's 5 go first (small is less served)
    assert s.plan().landing("d", "big", 7).by_flow == {"b": 300, "c": 5}
    # billed to small: small's 5 on c are its own; big's prompt, started, keeps its standing for a quantum
    # (128 tokens) and then shares the steps with small's: 180 of its 300 come before
    assert s.plan().landing("d", "small", 7).by_flow == {"b": 180, "c": 5}


def test_a_flow_without_requests_stands_where_its_next_request_would_join():
    shares = FairShare()
    shares.join("x")
    shares.charge("x", 40)
    assert shares.served("x") == 40
    # y has no requests: its next one joins at the lowest active counter (x's 40), not at the stale floor (0)
    assert shares.served("y") == 0
    shares.join("y")
    assert shares.served("y") == 40
    shares.charge("y", 100)
    shares.leave("y")
    shares.join("y")
    assert shares.served("y") == 140  # a flow that was served more keeps its counter when it returns


def test_an_account_that_becomes_active_starts_the_credit_below_the_floor_but_not_below_its_own_counter():
    shares = FairShare({"w": 2.0}, join_credit=100)
    shares.join("x")  # the floor is 0: x starts at -100
    shares.charge("x", 500)
    shares.join("y")  # the floor is x's 400, the lowest active counter: y starts 100 below it
    assert shares.served("y") == 300
    shares.join("w")
    assert shares.served("w") == 400 - 50  # w's weight is 2: its credit counts half on its counter
    shares.leave("w")
    shares.charge("y", 200)
    shares.leave("y")
    shares.join("y")  # y left at 500, above where a joiner starts: it keeps its counter
    assert shares.served("y") == 500
    with pytest.raises(ValueError, match="join_credit"):
        FairShare(join_credit=-1)
