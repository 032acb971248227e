"""Budget planner: exact against brute force, feasible, clear when infeasible, fast on real depths."""

from __future__ import annotations

import itertools
import math
import random
import time

import pytest

from checkpointing.planner.search import (BlockOptions, InfeasibleBudget, Option, PlanTooLarge,
                                   activation_peak, brute_force, min_feasible_budget, plan_budget,
                                   plan_cost)

_MIB = 1024 ** 2


def _random_block(rng: random.Random, index: int, own_peaks: bool = False) -> BlockOptions:
    """Option 0 keeps everything for free; the rest save less at a cost, some of them dominated.

    Block sizes vary by block, and costs come from a small grid half the time so that equal-cost
    plans (and so the tie-break) are common.
    """
    scale = rng.choice((1, 3, 10, 64))
    keep = rng.randint(4, 40) * scale
    options = [Option("none", keep, 0.0)]
    for k in range(rng.randint(1, 3)):
        saved = rng.randint(0, keep)
        cost = rng.choice((0.25, 0.5, 1.0, 1.5)) if rng.random() < 0.5 else rng.uniform(0.01, 2.0)
        # own_peaks: some options hold more or less than the block's K while their backward runs
        # (a recompute's working set), never less than they save.
        own = saved + rng.randint(0, 50) * scale if own_peaks and rng.random() < 0.7 else None
        options.append(Option(f"opt{k}", saved, cost, own))
    # K_i >= every saved_bytes as the model guarantees; now and then exactly the largest.
    peak = keep + (0 if rng.random() < 0.3 else rng.randint(0, 30) * scale)
    return BlockOptions(f"block{index}", tuple(options), peak)


def _random_chain(rng: random.Random, max_plans: int = 6000,
                  own_peaks: bool = False) -> list[BlockOptions]:
    """1 to 8 blocks, redrawn until brute force has at most max_plans plans (keeps tests fast)."""
    while True:
        blocks = [_random_block(rng, i, own_peaks) for i in range(rng.randint(1, 8))]
        if math.prod(len(b.options) for b in blocks) <= max_plans:
            return blocks


def _all_keep_peak(blocks: list[BlockOptions]) -> int:
    return activation_peak(blocks, [0] * len(blocks))


def _least_peak_by_enumeration(blocks: list[BlockOptions]) -> int:
    choices = itertools.product(*(range(len(b.options)) for b in blocks))
    return min(activation_peak(blocks, c) for c in choices)


@pytest.mark.parametrize("own_peaks", [False, True], ids=["block-peaks", "option-peaks"])
def test_matches_brute_force_on_random_heterogeneous_chains(own_peaks: bool) -> None:
    rng = random.Random(20240607)
    for case in range(300):
        blocks = _random_chain(rng, own_peaks=own_peaks)
        least = min_feasible_budget(blocks)
        most = _all_keep_peak(blocks)
        for budget in {least, most, *(rng.randint(least, most) for _ in range(2))}:
            expected = brute_force(blocks, budget)
            assert expected is not None, (case, budget)
            got = plan_budget(blocks, budget)
            assert activation_peak(blocks, got) <= budget, (case, budget, got)
            assert plan_cost(blocks, got) == pytest.approx(plan_cost(blocks, expected)), (case,)
            # Same tie-break as brute force (equal cost -> lower peak -> smaller indices).
            assert got == expected, (case, budget, blocks)


@pytest.mark.parametrize("own_peaks", [False, True], ids=["block-peaks", "option-peaks"])
def test_min_feasible_budget_is_the_least_peak_of_any_plan(own_peaks: bool) -> None:
    rng = random.Random(7)
    for _ in range(100):
        blocks = _random_chain(rng, own_peaks=own_peaks)
        assert min_feasible_budget(blocks) == _least_peak_by_enumeration(blocks)


def test_infeasible_budget_names_the_setting_and_the_least_feasible_bytes() -> None:
    rng = random.Random(11)
    for _ in range(50):
        blocks = _random_chain(rng)
        least = _least_peak_by_enumeration(blocks)
        assert brute_force(blocks, least - 1) is None
        with pytest.raises(InfeasibleBudget) as caught:
            plan_budget(blocks, least - 1)
        message = str(caught.value)
        assert "checkpointing.budget" in message
        assert f"{least} bytes" in message
        assert "GiB" in message and "\n" not in message
        assert caught.value.min_feasible_bytes == least
        assert plan_budget(blocks, least)  # the reported budget itself is met


def test_budget_at_or_above_all_keep_peak_keeps_everything_for_free() -> None:
    rng = random.Random(3)
    for _ in range(50):
        blocks = _random_chain(rng)
        most = _all_keep_peak(blocks)
        for budget in (most, most + 1, 10 * most):
            choice = plan_budget(blocks, budget)
            assert choice == [0] * len(blocks)
            assert plan_cost(blocks, choice) == 0.0


def test_activation_peak_by_hand() -> None:
    blocks = [BlockOptions("a", (Option("none", 4, 0.0), Option("full", 1, 1.0)), 10),
              BlockOptions("b", (Option("none", 3, 0.0), Option("full", 1, 1.0)), 8),
              BlockOptions("c", (Option("none", 5, 0.0), Option("full", 1, 1.0)), 12)]
    # Backward of c runs with a, b held: 4 + 3 + 12 = 19 beats 10, 4 + 8 = 12 and S_total = 12.
    assert activation_peak(blocks, [0, 0, 0]) == 19
    # a full, b kept: terms 10, 1 + 8 = 9, 1 + 3 + 12 = 16, total 1 + 3 + 5 = 9.
    assert activation_peak(blocks, [1, 0, 0]) == 16
    assert plan_cost(blocks, [1, 0, 1]) == 2.0
    # The general formula: with K below saved bytes (not a real block) S_total is the peak.
    small_k = [BlockOptions("x", (Option("none", 5, 0.0),), 1),
               BlockOptions("y", (Option("none", 5, 0.0),), 1)]
    assert activation_peak(small_k, [0, 0]) == 10


def test_ties_prefer_lower_peak_then_smaller_indices() -> None:
    same = BlockOptions("b", (Option("none", 10, 0.0), Option("lean", 3, 1.0),
                              Option("leaner", 2, 1.0), Option("twin", 2, 1.0)), 12)
    # One block must shed bytes; "leaner" and "twin" cost as much as "lean" with a lower peak,
    # and "leaner" comes first.
    budget = activation_peak([same, same], [1, 0])
    choice = plan_budget([same, same], budget)
    assert choice == [2, 0]
    assert choice == brute_force([same, same], budget)


def test_float_costs_are_compared_exactly() -> None:
    # Shedding 20 bytes before the last block's backward: cut "c" (0.3 s) or cut "a" and "b"
    # (0.1 + 0.2 s, which as exact binary fractions is a hair above 0.3; a fuzzy comparison would
    # call it a tie and take the lexicographically smaller [0, 1, 1, 0]).
    blocks = [BlockOptions("c", (Option("none", 20, 0.0), Option("cut", 0, 0.3)), 20),
              BlockOptions("a", (Option("none", 10, 0.0), Option("cut", 0, 0.1)), 10),
              BlockOptions("b", (Option("none", 10, 0.0), Option("cut", 0, 0.2)), 10),
              BlockOptions("d", (Option("none", 0, 0.0),), 40)]
    assert activation_peak(blocks, [0, 0, 0, 0]) == 80
    assert plan_budget(blocks, 60) == brute_force(blocks, 60) == [1, 0, 0, 0]
    # Exact ties (dyadic costs) do go to the smaller indices: 0.25 + 0.5 == 0.75.
    tied = [BlockOptions("c", (Option("none", 20, 0.0), Option("cut", 0, 0.75)), 20),
            BlockOptions("a", (Option("none", 10, 0.0), Option("cut", 0, 0.25)), 10),
            BlockOptions("b", (Option("none", 10, 0.0), Option("cut", 0, 0.5)), 10),
            BlockOptions("d", (Option("none", 0, 0.0),), 40)]
    # Equal cost and equal peak (20 bytes held while "d" peaks at 40, either way): indices decide.
    assert plan_budget(tied, 60) == brute_force(tied, 60) == [0, 1, 1, 0]


def _timed_plans(blocks: list[BlockOptions], fractions: tuple[float, ...]) -> float:
    least = min_feasible_budget(blocks)
    most = _all_keep_peak(blocks)
    slowest = 0.0
    for fraction in fractions:
        budget = int(least + fraction * (most - least))
        start = time.perf_counter()
        choice = plan_budget(blocks, budget)
        slowest = max(slowest, time.perf_counter() - start)
        assert activation_peak(blocks, choice) <= budget
    return slowest


def test_eighty_identical_blocks_with_four_options_plan_in_under_a_second() -> None:
    unit = 64 * _MIB  # one [seq, hidden] bf16 activation of a mid-size model
    options = (Option("none", 34 * unit, 0.0), Option("selective", 10 * unit, 0.004),
               Option("full", 2 * unit, 0.03), Option("offload", unit // 2, 0.002))
    blocks = [BlockOptions(f"layers.{i}", options, 40 * unit) for i in range(80)]
    assert _timed_plans(blocks, (0.0, 0.1, 0.3, 0.5, 0.7, 0.9, 1.0)) < 1.0

    # Bytes with no common structure and a non-convex cost curve grow the frontier more.
    awkward = (Option("none", 999_999_937, 0.0), Option("a", 610_000_007, 0.031),
               Option("b", 377_000_021, 0.29), Option("c", 1_000_003, 0.33))
    blocks = [BlockOptions(f"layers.{i}", awkward, 1_100_000_009) for i in range(80)]
    assert _timed_plans(blocks, (0.05, 0.3, 0.6, 0.9)) < 1.0


def test_128_alternating_blocks_with_three_options_plan_fast() -> None:
    unit = 16 * _MIB
    attention = (Option("none", 34 * unit, 0.0), Option("selective", 11 * unit, 0.004),
                 Option("full", 2 * unit, 0.03))
    mlp = (Option("none", 21 * unit + 5, 0.0), Option("selective", 7 * unit + 3, 0.002),
           Option("full", 2 * unit, 0.011))
    blocks = [BlockOptions(f"layers.{i}", attention if i % 2 == 0 else mlp,
                           (40 if i % 2 == 0 else 25) * unit) for i in range(128)]
    assert _timed_plans(blocks, (0.0, 0.2, 0.5, 0.8, 1.0)) < 1.0


def test_exponential_frontier_stops_with_a_clear_error() -> None:
    # Sizes and costs at distinct powers of two: every subset of dropped blocks is Pareto-optimal.
    blocks = [BlockOptions(f"b{i}", (Option("keep", 2 ** i, 0.0), Option("drop", 0, 2.0 ** i)),
                           2 ** i) for i in range(12)]
    with pytest.raises(PlanTooLarge, match="exact plan search"):
        plan_budget(blocks, 3 * 2 ** 10, max_states=100)
    assert plan_budget(blocks, 3 * 2 ** 10) == brute_force(blocks, 3 * 2 ** 10)


def test_bad_inputs_are_named() -> None:
    with pytest.raises(ValueError, match="no options"):
        plan_budget([BlockOptions("empty", (), 1)], 10)
    with pytest.raises(ValueError, match="cost_s"):
        plan_budget([BlockOptions("b", (Option("x", 1, float("nan")),), 1)], 10)
    with pytest.raises(ValueError, match="no option 3"):
        activation_peak([BlockOptions("b", (Option("x", 1, 0.0),), 1)], [3])
    assert plan_budget([], 0) == []
    with pytest.raises(InfeasibleBudget):  # e.g. a budget smaller than what lies outside blocks
        plan_budget([], -1)
