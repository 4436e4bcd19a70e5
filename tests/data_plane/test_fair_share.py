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
    # big holds all four seats, one per adapter: a request of small would take one at once (as ``step``
    # then does), and so would one with no tenant (its own account, e's flow, holds none); one of big's
    # own waits for one to turn over
    assert s.ahead_of("e", 4, billed_to="small").seat_now
    assert s.ahead_of("e", 4).seat_now
    assert not s.ahead_of("e", 4, billed_to="big").seat_now


def ahead_of_a_quiet_request_beside_a_flood_on_three_adapters(tenants: bool):
    """One seat, taken by a flood request on a; then three 5-token flood requests queued on each of a, b and c
    (tenant "big", or no tenant); what a 7-token request on d (tenant "small", or none) would wait behind.
    Without the join credit: the shares alone."""
    s = scheduler(max_num_seqs=1, max_loras=4, adapters="abcd", join_credit=0)

    def add(name: str, adapter: str, n: int) -> None:
        seq = Sequence(name, adapter, list(range(n)), SamplingParams(max_tokens=50), n + 50)
        seq.tenant = "big" if tenants else None
        s.add(seq)

    add("running", "a", 4)
    step(s)
    for adapter in "abc":
        for i in range(3):
            add(f"{adapter}{i}", adapter, 5)
    return s.ahead_of("d", 7, billed_to="small" if tenants else None)


def test_the_admission_estimate_counts_a_tenant_s_share_once_whatever_its_adapters():
    # the quiet request's 7 tokens are matched by 7 of the flood's: once for tenant big, whose three
    # adapters share one counter, and once per adapter where each adapter is its own share
    assert ahead_of_a_quiet_request_beside_a_flood_on_three_adapters(tenants=True).tokens == 7
    assert ahead_of_a_quiet_request_beside_a_flood_on_three_adapters(tenants=False).tokens == 3 * 7


def test_the_admission_estimate_counts_a_tenant_s_work_on_its_other_adapters_as_its_own():
    s = scheduler(max_num_seqs=1, max_loras=4, adapters="abcd", join_credit=0)
    for name, adapter, tenant, tokens in (("running", "a", "big", 5), ("big-b", "b", "big", 20),
                                          ("small-c", "c", "small", 5)):
        seq = Sequence(name, adapter, list(range(tokens)), SamplingParams(max_tokens=50), tokens + 50)
        seq.tenant = tenant
        s.add(seq)
        if name == "running":
            step(s)  # big's counter: 5, where small joins
    # a new 7-token request of big on d: big's 20 tokens queued on b are its own, all ahead of it (not a
    # share of 7), and small's 5 are within the 7 it is served alongside
    assert s.ahead_of("d", 7, billed_to="big").tokens == 20 + 5
    # billed to small: small's 5 on c are its own; big's are a share, the 7 it is served alongside
    assert s.ahead_of("d", 7, billed_to="small").tokens == 5 + 7


def test_a_flow_without_requests_stands_where_its_next_request_would_join():
    shares = FairShare()
    shares.join("x")
    shares.charge("x", 40)
    assert shares.standing("x") == shares.served("x") == 40
    # y has no requests: it would join at the lowest active counter (x's 40), not at the stale floor (0)
    assert shares.served("y") == 0 and shares.standing("y") == 40
    shares.join("y")
    shares.charge("y", 100)
    shares.leave("y")
    assert shares.standing("y") == 140  # a flow that was served more keeps its counter when it returns


def test_an_account_that_becomes_active_starts_the_credit_below_the_floor_but_not_below_its_own_counter():
    shares = FairShare({"w": 2.0}, join_credit=100)
    shares.join("x")  # the floor is 0: x starts at -100
    shares.charge("x", 500)
    shares.join("y")  # the floor is x's 400, the lowest active counter: y starts 100 below it
    assert shares.served("y") == 300
    assert shares.standing("w") == 400 - 50  # w's weight is 2: its credit counts half on its counter
    shares.charge("y", 200)
    shares.leave("y")
    shares.join("y")  # y left at 500, above where a joiner starts: it keeps its counter
    assert shares.served("y") == 500
    with pytest.raises(ValueError, match="join_credit"):
        FairShare(join_credit=-1)
