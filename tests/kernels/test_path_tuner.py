"""The CPU LoRA path is chosen by measurement: given the timings (an injected clock), the choice is
the measured fastest, made once per (plan, token bucket, segment bucket); on a real layer the path
taken is the one the tuner measured fastest, and measuring leaves the layer's output untouched."""

from __future__ import annotations

import pytest
import torch

from kernels import cpu_lora, cpu_tuner
from kernels.cpu_tuner import CpuLoraPath, CpuLoraRun, PathTuner, bucket, plan
from tests.kernels.test_lora_layer_paths import X, _qkv_layer, _step

PLAN = plan([[8, 0, 4]], in_features=64, out_features=32)
OTHER_PLAN = plan([[8, 16, 4]], in_features=64, out_features=32)
SEGMENTS = ((0, 0, 3, 0), (2, 3, 5, 1))


class Clock:
    """A clock that moves only when a scripted run happens: ``costs[run]`` (or ``costs[run.path]``)
    seconds per run, or the next of a list of seconds. ``runs`` records the paths run."""

    def __init__(self, costs: dict[CpuLoraPath | CpuLoraRun, float | list[float]]) -> None:
        self.t = 0.0
        self.costs = costs
        self.runs: list[CpuLoraPath] = []
        self.choices: list[CpuLoraRun] = []

    def __call__(self) -> float:
        return self.t

    def run(self, choice: CpuLoraRun) -> None:
        self.runs.append(choice.path)
        self.choices.append(choice)
        cost = self.costs[choice] if choice in self.costs else self.costs[choice.path]
        self.t += cost.pop(0) if isinstance(cost, list) else cost


@pytest.mark.parametrize("fastest", list(CpuLoraPath))
def test_the_measured_fastest_path_is_chosen(fastest):
    clock = Clock({p: 1e-4 if p is fastest else 3e-4 for p in CpuLoraPath})
    tuner = PathTuner(timer=clock, threads=1)
    assert tuner.choose(PLAN, 5, SEGMENTS, clock.run).path is fastest
    # one warm run of each, then two timed runs interleaved
    assert clock.runs == [*CpuLoraPath] * 3
    assert tuner.timings[(PLAN, 8, 2)][CpuLoraRun(fastest, 1)] == pytest.approx(1e-4)


def test_the_best_of_the_timed_runs_counts_so_one_stall_does_not_decide():
    # loop is fastest, but its first timed run met a stall (within PRUNE_FACTOR); warm-up times are not counted
    clock = Clock({CpuLoraPath.DENSE: [9.0, 2e-4, 2e-4], CpuLoraPath.GATHERED: [9.0, 3e-4, 3e-4],
                   CpuLoraPath.LOOP: [9.0, 1.5e-3, 1e-4], CpuLoraPath.SEGMENTED: [9.0, 2.5e-4, 2.5e-4]})
    assert PathTuner(timer=clock, threads=1).choose(PLAN, 1, SEGMENTS[:1], clock.run).path is CpuLoraPath.LOOP


def test_a_path_far_slower_on_its_first_run_is_not_run_again():
    # gathered takes PRUNE_FACTOR times more than dense and a bit on its first timed run: it cannot win
    slow = cpu_tuner.PRUNE_FACTOR * 1e-4 * 1.01
    clock = Clock({CpuLoraPath.DENSE: 1e-4, CpuLoraPath.GATHERED: slow, CpuLoraPath.LOOP: 2e-4,
                   CpuLoraPath.SEGMENTED: 3e-4})
    tuner = PathTuner(timer=clock, threads=1, repeats=3)
    assert tuner.choose(PLAN, 4, SEGMENTS, clock.run).path is CpuLoraPath.DENSE
    # warm runs, one timed run of each, then two more of the contenders only
    assert clock.runs == [*CpuLoraPath] * 2 + [CpuLoraPath.DENSE, CpuLoraPath.LOOP, CpuLoraPath.SEGMENTED] * 2
    # its first run's time
    assert tuner.timings[(PLAN, 4, 2)][CpuLoraRun(CpuLoraPath.GATHERED, 1)] == pytest.approx(slow)


def test_a_path_within_the_prune_factor_is_still_timed_and_can_win():
    # the loop's first timed run is slow (a burst of load), but within the factor: its next run decides
    clock = Clock({CpuLoraPath.DENSE: 2e-4, CpuLoraPath.GATHERED: 3e-4, CpuLoraPath.SEGMENTED: 2.5e-4,
                   CpuLoraPath.LOOP: [1e-4, cpu_tuner.PRUNE_FACTOR * 2e-4 * 0.99, 1e-4]})
    assert PathTuner(timer=clock, threads=1).choose(PLAN, 4, SEGMENTS, clock.run).path is CpuLoraPath.LOOP


# by buckets: gathered is measured while the token bucket is under 8 times the segment bucket
@pytest.mark.parametrize(("tokens", "segments", "gathered"), [(4, 1, True), (5, 1, False), (32, 8, True),
                                                              (33, 8, False), (512, 1, False), (256, 64, True)])
def test_the_gathered_path_is_not_measured_where_each_adapter_has_many_tokens(tokens, segments, gathered):
    clock = Clock(dict.fromkeys(CpuLoraPath, 1e-4))
    tuner = PathTuner(timer=clock, threads=1)
    tuner.choose(PLAN, tokens, tuple((s, s, s + 1, s) for s in range(segments)), clock.run)
    assert (CpuLoraPath.GATHERED in clock.runs) is gathered
    assert (CpuLoraRun(CpuLoraPath.GATHERED, 1) in next(iter(tuner.timings.values()))) is gathered


def test_each_path_is_also_measured_on_one_thread_and_the_fastest_pair_wins():
    # dense is fastest, and fastest of all on one thread: small ops can lose to the threads' hand-over
    clock = Clock({CpuLoraRun(CpuLoraPath.DENSE, 2): 3e-4, CpuLoraRun(CpuLoraPath.DENSE, 1): 1e-4,
                   CpuLoraPath.GATHERED: 5e-4, CpuLoraPath.LOOP: 4e-4, CpuLoraPath.SEGMENTED: 2e-4})
    tuner = PathTuner(timer=clock, threads=2)
    assert tuner.choose(PLAN, 4, SEGMENTS, clock.run) == CpuLoraRun(CpuLoraPath.DENSE, 1)
    assert set(clock.choices) == {CpuLoraRun(p, t) for p in CpuLoraPath for t in (1, 2)}
    assert clock.choices[:2] == [CpuLoraRun(CpuLoraPath.DENSE, 2), CpuLoraRun(CpuLoraPath.DENSE, 1)]


def test_with_one_thread_there_is_one_run_per_path():
    clock = Clock(dict.fromkeys(CpuLoraPath, 1e-4))
    PathTuner(timer=clock, threads=1).choose(PLAN, 4, SEGMENTS, clock.run)
    assert {c.threads for c in clock.choices} == {1} and len(clock.choices) == 3 * len(CpuLoraPath)


def test_a_run_on_one_thread_restores_the_thread_count_even_when_it_fails():
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        with pytest.raises(RuntimeError), cpu_tuner.intra_op_threads(1):
            assert torch.get_num_threads() == 1
            raise RuntimeError("a failing op")
        assert torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(before)


@pytest.mark.parametrize("threads", [1, 2])
def test_a_layer_runs_its_path_on_the_chosen_threads(monkeypatch, threads):
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    seen = []
    real = cpu_lora.lora_dense
    monkeypatch.setattr(cpu_tuner, "choose_path", lambda *args: CpuLoraRun(CpuLoraPath.DENSE, threads))
    monkeypatch.setattr(cpu_lora, "lora_dense", lambda *a: (seen.append(torch.get_num_threads()), real(*a)))
    try:
        _qkv_layer(torch.float32)(X, _step())
        assert seen == [threads] and torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(before)


def test_equal_timings_choose_in_the_enums_order():
    clock = Clock(dict.fromkeys(CpuLoraPath, 1e-4))
    assert PathTuner(timer=clock, threads=1).choose(PLAN, 3, SEGMENTS, clock.run).path is list(CpuLoraPath)[0]


def test_a_choice_is_measured_once_per_plan_token_bucket_and_segment_bucket():
    clock = Clock({CpuLoraPath.DENSE: 1e-4, CpuLoraPath.GATHERED: 2e-4, CpuLoraPath.LOOP: 3e-4,
                   CpuLoraPath.SEGMENTED: 4e-4})
    tuner = PathTuner(timer=clock, threads=1)
    tuner.choose(PLAN, 5, SEGMENTS, clock.run)
    measured = len(clock.runs)
    tuner.choose(PLAN, 7, SEGMENTS, clock.run)  # 5 and 7 tokens share the bucket of 8
    assert len(clock.runs) == measured
    for tokens, segments, plan_ in [(3, SEGMENTS, PLAN), (5, SEGMENTS * 2, PLAN), (5, SEGMENTS, OTHER_PLAN)]:
        tuner.choose(plan_, tokens, segments, clock.run)
        assert len(clock.runs) == measured + 3 * len(CpuLoraPath), (tokens, len(segments), plan_ is PLAN)
        measured = len(clock.runs)


def test_the_oldest_choices_are_forgotten_past_capacity():
    clock = Clock(dict.fromkeys(CpuLoraPath, 1e-4))
    tuner = PathTuner(timer=clock, capacity=2, threads=1)
    for tokens in (1, 2, 4):
        tuner.choose(PLAN, tokens, SEGMENTS, clock.run)
    assert sorted(key[1] for key in tuner.timings) == [2, 4]
    before = len(clock.runs)
    tuner.choose(PLAN, 1, SEGMENTS, clock.run)
    assert len(clock.runs) == before + 3 * len(CpuLoraPath), "a forgotten key is measured again"


@pytest.mark.parametrize(("n", "expected"), [(0, 1), (1, 1), (2, 2), (3, 4), (8, 8), (9, 16), (200, 256)])
def test_buckets_are_powers_of_two(n, expected):
    assert bucket(n) == expected


@pytest.mark.parametrize("settings", [dict(repeats=0), dict(capacity=0), dict(threads=0)])
def test_bad_settings_are_refused(settings):
    with pytest.raises(ValueError, match="at least 1"):
        PathTuner(**settings)


def test_a_real_layer_takes_the_path_measured_fastest_and_measuring_changes_no_output(monkeypatch):
    tuner = PathTuner()
    monkeypatch.setattr(cpu_tuner, "PATH_TUNER", tuner)
    layer = _qkv_layer(torch.float32)
    measured = layer(X, _step())  # the first step of this shape measures every path
    assert len(tuner.timings) == 1
    ((key, seconds),) = tuner.timings.items()
    taken = layer.backend.path(layer.base(X), X, _step().lora)  # a later step: no measurement
    assert taken == min(seconds, key=lambda c: seconds[c])
    assert all(t > 0 for t in seconds.values())
    assert torch.equal(layer(X, _step()), measured), "the measurement's runs reached the real output"
