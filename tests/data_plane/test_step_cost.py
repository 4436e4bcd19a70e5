"""The step-time model and the step budget it implies: fitted from timed steps, never negative, and a
step that prefills stays within its target beside the decodes it carries."""

from __future__ import annotations

import pytest

from data_plane.engine.step_cost import (
    DEFAULT_ITL_GROWTH,
    KNEE_EFFICIENCY,
    MIN_PREFILL_TOKENS,
    TILE,
    StepCost,
    StepShape,
)

# A device where a step costs 20 ms, 2 ms per decode row, 1 ms per prefill token, 3 ms per prefilling
# sequence and 4 ms per adapter (a pod without row tiles: no tile cost).
TRUE = (0.020, 0.002, 0.001, 0.003, 0.004, 0.0)
SHAPES = [StepShape(1), StepShape(1, adapters=1), StepShape(32, adapters=4), StepShape(0, 256, 1, 1),
          StepShape(0, 256, 2, 1), StepShape(31, 128, 1, 4)]


def seconds(shape: StepShape, coef=TRUE, row_tile: int = 0) -> float:
    return sum(c * f for c, f in zip(coef, shape.features(row_tile), strict=True))


def fitted(target_itl_s: float = 0.0, max_batched_tokens: int = 1024,
           itl_growth: float = DEFAULT_ITL_GROWTH) -> StepCost:
    costs = StepCost(target_itl_s, max_batched_tokens, itl_growth)
    for shape in SHAPES:
        costs.observe_prior(shape, seconds(shape))
    return costs


def test_timed_steps_of_known_shapes_recover_the_device_costs():
    costs = fitted()
    assert costs.coef == pytest.approx(TRUE, rel=1e-6, abs=1e-9)
    assert costs.predict(StepShape(7, 40, 2, 3)) == pytest.approx(seconds(StepShape(7, 40, 2, 3)))


def test_nothing_timed_predicts_nothing_and_lets_a_step_take_all_its_tokens():
    costs = StepCost(0.0, 512)
    assert costs.predict(StepShape(8, 100, 1, 1)) == 0.0
    assert costs.prefill_budget(8, 1) == 512 - 8


def test_coefficients_are_never_negative():
    # steps that got faster with more decode rows (noise): the fit keeps that cost at zero, not below
    costs = StepCost()
    for rows, s in ((1, 0.030), (8, 0.029), (16, 0.028), (32, 0.027)):
        costs.observe_prior(StepShape(rows), s)
    costs.observe_prior(StepShape(0, 100, 1), 0.130)
    assert (costs.coef >= 0).all()
    assert costs.predict(StepShape(64)) > 0


def most_prefill_within(costs: StepCost, rows: int, adapters: int, target: float) -> None:
    """The budget beside ``rows`` decodes keeps the step within ``target``, and one more token would not."""
    budget = costs.prefill_budget(rows, adapters)
    assert budget > MIN_PREFILL_TOKENS
    assert costs.predict(StepShape(rows, budget, 1, adapters)) <= target + 1e-9
    assert costs.predict(StepShape(rows, budget + 1, 1, adapters)) > target


def test_by_default_a_step_that_prefills_lasts_at_most_the_growth_over_its_decodes_alone():
    costs = fitted()
    for rows, adapters in ((8, 2), (16, 3), (32, 4), (120, 4)):
        decodes = costs.predict(StepShape(rows, adapters=adapters))
        most_prefill_within(costs, rows, adapters, DEFAULT_ITL_GROWTH * decodes)
    # one decode of 26 ms: 1.4x leaves 36.4 - 29 ms, 7 tokens; prefill still gets its floor
    assert costs.prefill_budget(1, 1) == MIN_PREFILL_TOKENS
    # 8 decodes over 2 adapters take 20 + 16 + 8 = 44 ms; 1.4x that is 61.6 ms, less the prefilling
    # sequence's 3 ms: 14 tokens at 1 ms each
    assert costs.prefill_budget(8, 2) == 14
    assert "1.4x its decodes alone" in costs.summary()


def test_a_prompt_s_own_adapter_and_a_further_prefilling_sequence_are_paid_from_the_same_target():
    costs = fitted()
    # 8 decodes over 2 adapters: 61.6 ms, as above; a prompt of a third adapter costs its 4 ms of the 14
    assert costs.prefill_budget(8, 2, new_adapters=1) == 10
    # two prefilling sequences pay two sequences' cost (3 ms more), the second's adapter too (4 ms more)
    assert costs.prefill_budget(8, 2, prefill_seqs=2, new_adapters=1) == 7
    assert costs.prefill_budget(8, 2, prefill_seqs=2, new_adapters=2) == 3
    # no floor for a further sequence: where its cost leaves nothing, it gets nothing
    assert costs.prefill_budget(8, 2, prefill_seqs=6, new_adapters=2) == 0
    # one decode: the first sequence gets its floor (8, where the target fits 7), two sequences fit 4 in
    # all, less than the first took: a second never joins it
    assert costs.prefill_budget(1, 1) == MIN_PREFILL_TOKENS
    assert costs.prefill_budget(1, 1, prefill_seqs=2) == 4


def test_a_larger_growth_lets_a_step_prefill_more():
    assert fitted(itl_growth=2.0).prefill_budget(8, 2) == 41  # 88 - 44 - 3 ms
    assert fitted(itl_growth=2.0).prefill_budget(8, 2) > fitted().prefill_budget(8, 2)


def test_growth_zero_fills_a_step_to_the_larger_of_the_knee_and_the_growth_over_the_decodes_alone():
    costs = fitted(itl_growth=0)
    for rows, adapters in ((1, 1), (8, 2), (16, 3), (32, 4), (120, 4)):
        decodes = costs.predict(StepShape(rows, adapters=adapters))
        most_prefill_within(costs, rows, adapters, max(DEFAULT_ITL_GROWTH * decodes, costs.knee_step_s()))


def test_the_knee_is_the_step_whose_prefill_runs_at_the_chosen_fraction_of_the_peak_rate():
    costs = fitted(itl_growth=0)
    knee = costs.knee_step_s()
    # fixed part of a prefill step on the TRUE device: 20 + 3 + 4 ms; at the knee its prompt tokens take
    # KNEE_EFFICIENCY of the step, so the step prefills at that fraction of 1 / (1 ms per token)
    assert knee == pytest.approx(0.027 / (1 - KNEE_EFFICIENCY))
    tokens = (knee - 0.027) / TRUE[2]
    assert tokens / knee == pytest.approx(KNEE_EFFICIENCY / TRUE[2])
    # nothing decoding but one: the knee, not 1.4x a 26 ms decode, sets the step (135 ms: 106 tokens)
    assert costs.prefill_budget(1, 1) == 106  # (135 - 29) ms of the step left at 1 ms per token
    # a full batch: 1.4x its decodes is longer than the knee and sets the step
    assert DEFAULT_ITL_GROWTH * costs.predict(StepShape(120, adapters=4)) > knee


def test_an_explicit_target_sets_the_step_time():
    costs = fitted(target_itl_s=0.2)
    budget = costs.prefill_budget(8, 2)
    assert costs.predict(StepShape(8, budget, 1, 2)) <= 0.2 + 1e-9 < costs.predict(StepShape(8, budget + 1, 1, 2))


def test_prefill_always_progresses_even_when_the_target_leaves_no_room():
    assert fitted(target_itl_s=0.001).prefill_budget(32, 4) == MIN_PREFILL_TOKENS
    # one decode of 26 ms beside a 30 ms target leaves 30 - 26 - 3 = 1 ms, one token: the floor gives eight
    assert fitted(target_itl_s=0.030).prefill_budget(1, 1) == MIN_PREFILL_TOKENS


def test_with_nothing_decoding_a_step_prefills_up_to_its_token_limit():
    assert fitted(max_batched_tokens=700).prefill_budget(0, 0) == 700
    assert fitted(max_batched_tokens=700).prefill_budget(8, 1) <= 700 - 8


def test_served_steps_move_the_model_to_the_device_as_it_is_now():
    costs = fitted()
    slower = tuple(2 * c for c in TRUE)  # the device is now twice as slow (another process took a core)
    for i in range(600):
        shape = SHAPES[i % len(SHAPES)]
        costs.observe(shape, seconds(shape, slower))
    assert costs.predict(StepShape(16, 64, 1, 2)) == pytest.approx(seconds(StepShape(16, 64, 1, 2), slower), rel=0.05)


def test_a_negative_or_infinite_target_is_refused():
    for bad in (-1.0, float("inf"), float("nan")):
        with pytest.raises(ValueError, match="target_itl_s"):
            StepCost(bad)


def test_a_growth_that_would_not_let_prefill_in_is_refused():
    for bad in (-1.0, 0.5, 1.0, float("inf"), float("nan")):
        with pytest.raises(ValueError, match="itl_growth"):
            StepCost(itl_growth=bad)


def test_a_rushed_step_prefills_up_to_the_knee_whatever_the_growth():
    assert fitted().prefill_budget(8, 2, rush=True) == fitted(itl_growth=0).prefill_budget(8, 2)
    assert fitted().prefill_budget(8, 2, rush=True) > fitted().prefill_budget(8, 2)
    # an absolute target longer than the knee stays
    assert fitted(target_itl_s=1.0).prefill_budget(8, 2, rush=True) == fitted(target_itl_s=1.0).prefill_budget(8, 2)


def test_prefill_steps_that_cost_more_than_their_tokens_do_not_raise_what_a_step_may_prefill():
    """On a CPU pod a step with a few prompt tokens may cost far more than its decodes (its projections run
    in fixed row tiles: 31 decodes took 73 ms, with 8 prompt tokens 125 ms): that is not a cost of
    prefilling at all, and must not raise the step a prefill may fill."""
    costs = StepCost()  # row tiles not modelled
    tile = 0.050  # a second row tile, paid by any step past 32 rows, decode or prefill
    for shape, s in [(StepShape(1), 0.060), (StepShape(1, adapters=1), 0.062), (StepShape(32, adapters=4), 0.073),
                     (StepShape(0, 256, 1, 1), 0.060 + 7 * tile), (StepShape(0, 256, 2, 1), 0.061 + 7 * tile),
                     (StepShape(31, 128, 1, 4), 0.073 + 4 * tile), (StepShape(31, 8, 1, 4), 0.073 + tile)]:
        costs.observe_prior(shape, s)
    decodes = costs.predict(StepShape(31, adapters=4))
    assert costs.predict(StepShape(31, 0, 1, 4)) < DEFAULT_ITL_GROWTH * decodes
    most_prefill_within(costs, 31, 4, DEFAULT_ITL_GROWTH * decodes)
    assert "eager" not in costs.summary()


# A CPU pod whose projections run in 32-row tiles: a step costs 10 ms, 0.5 ms per decode row, 0.2 ms per
# prompt token, 30 ms per tile of rows (measured on the demo pod: 16 decodes 48 ms, with 16 prompt tokens
# 65 ms, with 17 95 ms).
TILED = (0.010, 0.0005, 0.0002, 0.0, 0.001, 0.030)
TILED_SHAPES = [StepShape(1), StepShape(1, adapters=1), StepShape(32, adapters=4), StepShape(0, 256, 1, 1),
                StepShape(0, 256, 2, 1), StepShape(31, 128, 1, 4), StepShape(31, 8, 1, 4), StepShape(1, 31, 1, 1),
                StepShape(1, 32, 1, 1)]


def tiled(itl_growth: float = DEFAULT_ITL_GROWTH) -> StepCost:
    costs = StepCost(row_tile=32, itl_growth=itl_growth)
    for shape in TILED_SHAPES:
        costs.observe_prior(shape, seconds(shape, TILED, row_tile=32))
    return costs


def test_row_tiles_are_counted_from_the_rows_and_a_step_with_a_sequence_fills_one():
    assert StepShape(16, 16, 1).features(row_tile=32)[TILE] == 1.0
    assert StepShape(16, 17, 1).features(row_tile=32)[TILE] == 2.0
    assert StepShape(0, 0, 1, 1).features(row_tile=32)[TILE] == 1.0  # the knee's fixed part pays a tile
    assert StepShape(0).features(row_tile=32)[TILE] == 0.0
    assert StepShape(40, 40, 1).features()[TILE] == 0.0  # not tiled (a GPU pod)


def test_the_start_up_shapes_recover_a_tiled_pods_costs():
    costs = tiled()
    assert costs.coef == pytest.approx(TILED, rel=1e-6, abs=1e-9)
    assert "per 32-row tile 30 ms" in costs.summary() and "eager" not in costs.summary()


def test_with_row_tiles_a_step_fills_the_tile_it_pays_for_and_crosses_into_another_only_within_its_target():
    costs = tiled()
    # 16 decodes over 2 adapters: 10 + 8 + 2 + 30 = 50 ms; 1.4x is 70 ms: the 16 rows left in the first tile
    # (3.2 ms) fit, a second tile (30 ms) does not
    assert costs.prefill_budget(16, 2) == 16
    assert costs.predict(StepShape(16, 16, 1, 2)) <= 0.070 < costs.predict(StepShape(16, 17, 1, 2))
    # with a larger growth a second tile fits: 2x 50 = 100 ms, room for 48 tokens past the decodes' tile
    assert tiled(itl_growth=2.0).prefill_budget(16, 2) == 48
    # 31 decodes leave one row in their tile; the floor of MIN_PREFILL_TOKENS pays a second tile, and fills it
    assert costs.prefill_budget(31, 4) == 64 - 31
    floor_step = costs.predict(StepShape(31, MIN_PREFILL_TOKENS, 1, 4))
    assert costs.predict(StepShape(31, 33, 1, 4)) == pytest.approx(floor_step + 25 * costs.coef[2])
    for rows, adapters in ((1, 1), (8, 2), (16, 3)):
        decodes = costs.predict(StepShape(rows, adapters=adapters))
        most_prefill_within(costs, rows, adapters, DEFAULT_ITL_GROWTH * decodes)


def test_with_row_tiles_the_knee_counts_a_tile_by_its_rows_not_as_a_fixed_cost():
    """At the knee a step's prompt tokens take KNEE_EFFICIENCY of it, each token costing its own part and its
    share of a tile: the fixed part is the step, the prefilling sequence and the adapter (10 + 0 + 1 ms)."""
    costs = tiled()
    assert costs.knee_step_s() == pytest.approx(0.011 / (1 - KNEE_EFFICIENCY))
    knee = costs.knee_step_s()
    per_token = TILED[2] + TILED[TILE] / 32
    assert (knee - 0.011) / per_token / knee == pytest.approx(KNEE_EFFICIENCY / per_token)
