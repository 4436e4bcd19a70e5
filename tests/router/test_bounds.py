"""The router's two bounds on load over the cost's ranking (router/scoring.py, ``bounded``): the share of the
requests it sent each pod lately, which moves a hot adapter's requests and not a rarely used one's, and the
outstanding requests of a pod where the request would wait, for an adapter slot or for a seat."""

from __future__ import annotations

from router.config import RouterConfig
from router.picker import PodPicker
from router.scoring import LOAD_BOUND, SHARE_BOUND, SHARE_DECAY_S, Choice, Decision, bounded
from router.view import FleetView, PodView, Tier


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def fleet(hot: PodView, others: int = 3) -> FleetView:
    idle = tuple(PodView(f"p{i}", f"p{i}:1", slots_total=4) for i in range(1, others + 1))
    return FleetView(frozenset({"a", "rare"}), (hot, *idle), 1.0)


def sent(picker: PodPicker, pod: str, adapter: str, count: int) -> None:
    """``count`` requests sent to ``pod`` and finished: a share, and no outstanding request left."""
    for _ in range(count):
        picker.started(pod, adapter)
        picker.finished(pod)


HOT = PodView("hot", "h:1", slots_total=4, slots_used=2, residency={"a": Tier.DEVICE, "rare": Tier.CPU})
VIEW = fleet(HOT)


def test_the_shipped_bounds_are_a_fifth_over_outstanding_requests_and_a_tenth_over_the_share():
    assert LOAD_BOUND == RouterConfig.load_bound == 0.2
    assert SHARE_BOUND == RouterConfig.share_bound == 0.1


def test_a_hot_adapters_requests_spill_to_the_next_best_pod_once_its_pod_is_past_the_share_bound():
    clock = Clock()
    picker, unbounded = (PodPicker(lambda: VIEW, clock=clock, share_bound=b) for b in (SHARE_BOUND, 0))
    for p in (picker, unbounded):
        sent(p, "hot", "a", 33)
    # 33 of 33 lately: each pod may have (1.1 * 34 / 4) = 9.35, at least 15; hot has 33
    assert [(c.pod.id, c.decision) for c in picker.choose("a")][:2] == [("p1", Decision.FREE_SLOT),
                                                                       ("p2", Decision.FREE_SLOT)]
    assert picker.choose("a")[-1].pod.id == "hot"
    assert unbounded.choose("a")[0].pod.id == "hot"  # the device hit, where the cost alone decides
    # within the bound, the cost decides again: the other pods' shares raise the mean
    for pod in ("p1", "p2", "p3"):
        sent(picker, pod, "b", 30)
    assert picker.choose("a")[0].pod.id == "hot"  # 33 against (1.1 * 124 / 4) = 34.1


def test_a_rarely_used_adapter_keeps_its_pod_past_the_share_bound():
    clock = Clock()
    picker = PodPicker(lambda: VIEW, clock=clock)
    sent(picker, "hot", "a", 40)
    sent(picker, "hot", "rare", 1)
    # "rare" has 1 of a mean of 41 / 4 lately, under a fifth of it: its CPU copy on hot beats a load elsewhere
    assert [(c.pod.id, c.decision) for c in picker.choose("rare")][0] == ("hot", Decision.CPU_HIT)
    assert picker.choose("a")[0].pod.id == "p1"  # while the hot adapter's own requests spill
    # once it asks for a fifth of a pod's mean share, it is moved like any other adapter
    sent(picker, "hot", "rare", 1)  # 2 of 42 / 4 = 10.5 lately: under 2.1
    assert picker.choose("rare")[0].pod.id == "hot"
    sent(picker, "hot", "rare", 1)  # 3 of 43 / 4 = 10.75: over 2.15
    assert picker.choose("rare")[0].pod.id == "p1"


def test_a_pod_sent_under_a_request_every_two_seconds_lately_is_never_past_the_share_bound():
    clock = Clock()
    picker = PodPicker(lambda: VIEW, clock=clock)
    sent(picker, "hot", "a", 14)  # every request so far, but 14 < 15: a light fleet keeps the adapter on one pod
    assert picker.choose("a")[0].pod.id == "hot"
    sent(picker, "hot", "a", 1)
    assert picker.choose("a")[0].pod.id == "p1"


def test_the_share_fades_with_the_pickers_clock():
    clock = Clock()
    picker = PodPicker(lambda: VIEW, clock=clock)
    sent(picker, "hot", "a", 60)
    assert picker.choose("a")[0].pod.id == "p1"
    clock.now += 2 * SHARE_DECAY_S  # 60 / e^2 = 8.1: under the floor of 15
    assert picker.choose("a")[0].pod.id == "hot"


def waiting_fleet(hot_running: int) -> FleetView:
    """A pod holding "a" in host memory with every slot serving, beside pods that would evict for it, their
    slots serving too: the CPU hit (0.5 + the slot wait) beats a load that waits as long (20 + the slot wait)."""
    hot = PodView("hot", "h:1", slots_total=2, slots_used=2, slots_busy=2, residency={"a": Tier.CPU},
                  running=hot_running)
    others = tuple(PodView(f"p{i}", f"p{i}:1", slots_total=2, slots_used=2, slots_busy=2, running=1)
                   for i in (1, 2))
    return FleetView(frozenset({"a"}), (hot, *others), 1.0)


def test_where_the_request_would_wait_for_a_slot_a_pod_past_the_outstanding_bound_goes_behind():
    view = waiting_fleet(hot_running=6)
    assert PodPicker(lambda: view, load_bound=0).choose("a")[0].pod.id == "hot"  # 0.5 + 40 + 6 < 20 + 40 + 1
    # 8 outstanding over 3 pods: each may hold ceil(1.2 * 9 / 3) = 4 with this request, at least 4; hot holds 6
    ranked = PodPicker(lambda: view).choose("a")
    assert [(c.pod.id, c.decision, c.waits_for_slot) for c in ranked] == [
        ("p1", Decision.EVICT, True), ("p2", Decision.EVICT, True), ("hot", Decision.CPU_HIT, True)]
    # within the bound the cost decides: 3 outstanding is under 4
    assert PodPicker(lambda: waiting_fleet(hot_running=3)).choose("a")[0].pod.id == "hot"


def test_the_outstanding_bound_leaves_a_request_that_would_not_wait_for_a_slot_where_the_cost_put_it():
    busy = PodView("hot", "h:1", slots_total=4, slots_used=1, residency={"a": Tier.DEVICE}, running=6)
    view = fleet(busy, others=2)  # 6 outstanding against 0 and 0: far past ceil(1.2 * 7 / 3) = 3, at least 4
    ranked = PodPicker(lambda: view).choose("a")
    assert (ranked[0].pod.id, ranked[0].decision, ranked[0].waits_for_slot) == ("hot", Decision.DEVICE_HIT, False)


def seated_fleet(running: int, seats: int) -> FleetView:
    """A pod holding "a" in a slot, running ``running`` of its ``seats``, beside two idle pods with free slots: the
    device hit (0 + running + KV) beats their loads (14) while it runs fewer than 14."""
    hot = PodView("hot", "h:1", slots_total=4, slots_used=1, residency={"a": Tier.DEVICE}, running=running,
                  seats=seats, kv_usage=running / seats if seats else 0.0)
    return fleet(hot, others=2)


def test_where_every_seat_of_the_best_pod_is_taken_a_pod_past_the_outstanding_bound_goes_behind():
    # 6 running of 6 seats: the request would wait for one to finish. 6 outstanding over 3 pods: each may hold
    # ceil(1.2 * 7 / 3) = 3 with this request, at least 4
    ranked = PodPicker(lambda: seated_fleet(running=6, seats=6)).choose("a")
    assert [(c.pod.id, c.decision, c.waits_for_seat) for c in ranked] == [
        ("p1", Decision.FREE_SLOT, False), ("p2", Decision.FREE_SLOT, False), ("hot", Decision.DEVICE_HIT, True)]
    assert PodPicker(lambda: seated_fleet(running=6, seats=6), load_bound=0).choose("a")[0].pod.id == "hot"


def test_a_pod_with_a_free_seat_and_its_adapter_in_a_slot_keeps_the_request_however_far_past_the_mean():
    for seats in (8, 0):  # a seat free; a pod that reports no seats is never taken to be full
        ranked = PodPicker(lambda s=seats: seated_fleet(running=6, seats=s)).choose("a")
        assert (ranked[0].pod.id, ranked[0].waits) == ("hot", False)


def test_requests_the_router_started_since_its_read_take_seats():
    view = seated_fleet(running=5, seats=6)
    picker = PodPicker(lambda: view)
    assert picker.choose("a")[0].pod.id == "hot"  # one seat free: 5 outstanding past 4, but the request need not wait
    picker.started("hot", "a")  # 6 of 6 seats taken as far as this router knows
    assert [(c.pod.id, c.waits_for_seat) for c in picker.choose("a")][-1] == ("hot", True)
    assert picker.choose("a")[0].pod.id == "p1"
    picker.finished("hot")
    assert picker.choose("a")[0].pod.id == "hot"


def test_requests_the_router_started_since_its_read_count_toward_the_outstanding_bound():
    view = waiting_fleet(hot_running=2)
    picker = PodPicker(lambda: view)
    assert picker.choose("a")[0].pod.id == "hot"
    picker.started("hot", "a")
    picker.started("hot", "a")  # 4 of 6 outstanding: ceil(1.2 * 7 / 3) = 3, at least 4
    assert picker.choose("a")[0].pod.id == "p1"
    picker.finished("hot")
    assert picker.choose("a")[0].pod.id == "hot"


def test_the_bounds_never_send_an_adapter_request_to_a_pod_without_slots_nor_count_those_pods():
    idle_base = tuple(PodView(f"base-{i}", f"b{i}:1", slots_total=0) for i in range(8))
    lora = (PodView("l1", "l1:1", slots_total=2, residency={"a": Tier.DEVICE}),
            PodView("l2", "l2:1", slots_total=2, residency={"a": Tier.DEVICE}))
    picker = PodPicker(lambda: FleetView(frozenset({"a"}), (*idle_base, *lora), 1.0), clock=Clock())
    sent(picker, "l1", "a", 40)
    sent(picker, "l2", "a", 30)
    # over the two LoRA pods each may have 1.1 * 71 / 2 = 39.05 lately: l1 is past it. Weighing the idle base-only
    # pods too would have put the bound at its floor of 15, with both LoRA pods past it and the ranking unmoved.
    assert [c.pod.id for c in picker.choose("a")] == ["l2", "l1"]


def choice(pod: str, precision: str, cost: float, share: float) -> Choice:
    return Choice(PodView(pod, f"{pod}:1", precision=precision), Decision.DEVICE_HIT, cost, share=share)


def test_the_bounds_keep_the_best_pods_precision():
    # the only bfloat16 pod is the mean of its precision: never past the bound, however idle the others
    alone = [choice("bf16", "bfloat16", 0.0, 90.0), choice("f32-a", "float32", 1.0, 0.0),
             choice("f32-b", "float32", 2.0, 0.0)]
    assert bounded(alone, 0, SHARE_BOUND) == alone
    # past the bound among bfloat16 pods, the request spills to another bfloat16 pod, not to the idle float32 one
    two = [choice("bf16-hot", "bfloat16", 0.0, 90.0), choice("f32", "float32", 1.0, 0.0),
           choice("bf16-b", "bfloat16", 2.0, 40.0)]
    assert [c.pod.id for c in bounded(two, 0, SHARE_BOUND)] == ["bf16-b", "f32", "bf16-hot"]  # f32 stays second


def test_the_share_bound_is_a_tenth_above_the_mean_counting_the_new_request():
    shares = (90, 60, 50, 40, 40, 40, 40, 40, 40, 10)  # cheapest first; 450 lately: 1.1 * 451 / 10 = 49.61 each
    ranked = [choice(f"p{i}", "", float(i), s) for i, s in enumerate(shares)]
    assert [c.pod.id for c in bounded(ranked, LOAD_BOUND, SHARE_BOUND)] == [
        f"p{i}" for i in (3, 4, 5, 6, 7, 8, 9, 0, 1, 2)]
    assert bounded(ranked, LOAD_BOUND, SHARE_BOUND, adapter_share=8.9) == ranked  # under a fifth of 45: unmoved
    assert bounded(ranked, LOAD_BOUND, 0) == ranked  # 0: no bound
