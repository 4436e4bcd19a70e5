"""The estimate of how long a new request waits for its first token, from measured step and service
times: prefill of the work ahead, plus waiting for a seat when the running requests fill them."""

from __future__ import annotations

import pytest

from data_plane.engine.admission import Ahead, DelayEstimator, Load, retry_after

IDLE = Load(running=0, running_decodes=0, running_remaining=())


def estimator(step_s: float | None = 0.1, service_s: float | None = None) -> DelayEstimator:
    e = DelayEstimator(max_num_seqs=4, max_num_batched_tokens=100)
    if step_s is not None:
        e.observe_step(step_s)
    if service_s is not None:
        e.observe_service(service_s)
    return e


def test_nothing_measured_yet_estimates_no_wait():
    assert estimator(step_s=None).estimate(Ahead(50, 5000), 10, IDLE) == 0.0


def test_with_free_seats_the_wait_is_the_prefill_of_the_work_ahead_and_its_own():
    e = estimator()
    assert e.estimate(Ahead(0, 0), 30, IDLE) == pytest.approx(0.1)  # one step
    assert e.estimate(Ahead(2, 250), 30, IDLE) == pytest.approx(0.3)  # 280 tokens: three steps of 100
    # two running decodes take two tokens of each step's budget: 280 tokens over 98 a step still take three
    assert e.estimate(Ahead(1, 250), 30, Load(2, 2, (5, 5))) == pytest.approx(0.3)


def test_when_seats_are_full_each_missing_seat_waits_a_share_of_the_service_time():
    e = estimator(service_s=8.0)
    full = Load(running=4, running_decodes=4, running_remaining=(50, 50, 50, 50))
    # four seats turn over once per 8 s of service: one seat frees every 2 s
    assert e.estimate(Ahead(0, 0), 4, full) == pytest.approx(0.1 + 2.0)
    assert e.estimate(Ahead(3, 30), 4, full) == pytest.approx(0.1 + 4 * 2.0)


def test_a_request_that_takes_a_seat_at_the_next_step_waits_only_for_prefill():
    e = estimator(service_s=8.0)
    full = Load(running=4, running_decodes=4, running_remaining=(50, 50, 50, 50))
    assert e.estimate(Ahead(0, 0, seat_now=True), 4, full) == pytest.approx(0.1)


def test_before_any_request_finished_a_seat_turns_over_in_the_running_requests_remaining_tokens():
    e = estimator()
    full = Load(running=4, running_decodes=4, running_remaining=(10, 20, 30, 40))
    assert e.estimate(Ahead(0, 0), 4, full) == pytest.approx(0.1 + 25 * 0.1 / 4)


def test_the_averages_follow_recent_samples():
    e = estimator(step_s=1.0, service_s=10.0)
    for _ in range(40):
        e.observe_step(0.2)
        e.observe_service(4.0)
    assert e.step_s == pytest.approx(0.2, rel=1e-3) and e.service_s == pytest.approx(4.0, rel=1e-3)


def test_the_retry_hint_is_the_excess_over_the_time_allowed_within_bounds():
    assert retry_after(3.5, 1.0) == pytest.approx(2.5)
    assert retry_after(1.01, 1.0) == 0.05
    assert retry_after(500.0, 1.0) == 60.0
