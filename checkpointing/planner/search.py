"""Choosing one memory option per block so activations fit a byte budget at the least step cost.

The model is a chain of blocks: forward 0..N-1, then backward N-1..0. Block i's option o holds
`saved_bytes` from its forward until its backward and adds `cost_s` seconds to a step (recompute,
or transfer time that is not hidden). While block i's backward runs, `peak_bytes` (K_i, which may
depend on the option) are alive on top of what blocks 0..i-1 still hold. So a plan's activation peak is

    max( S_total, max_i (S_{<i} + K_i) ),   S_{<i} = saved bytes of blocks 0..i-1.

The planner is exact (it returns what brute force over all option combinations returns); see
`plan_budget` for the algorithm and why its pruning loses nothing. Pure Python: it runs before any
model exists, from measured or estimated per-block numbers.
"""

from __future__ import annotations

import itertools
import math
from bisect import bisect_right
from dataclasses import dataclass
from typing import Optional, Sequence

_GIB = 1024 ** 3


@dataclass(frozen=True)
class Option:
    name: str
    saved_bytes: int
    cost_s: float
    # K_i of this option, when it differs from the block's (see BlockOptions.peak_of); a
    # recomputing option may hold more or less while its backward runs than keeping everything.
    peak_bytes: Optional[int] = None


@dataclass(frozen=True)
class BlockOptions:
    name: str                 # block name, for messages
    options: tuple[Option, ...]
    peak_bytes: int           # K_i: alive while this block's backward runs (options may override)

    def peak_of(self, index: int) -> int:
        option = self.options[index]
        return self.peak_bytes if option.peak_bytes is None else option.peak_bytes


class InfeasibleBudget(ValueError):
    """No plan keeps the activation peak within `checkpointing.budget`."""

    def __init__(self, budget_bytes: int, min_feasible_bytes: int) -> None:
        self.budget_bytes = budget_bytes
        self.min_feasible_bytes = min_feasible_bytes
        super().__init__(
            f"checkpointing.budget={budget_bytes} bytes cannot be met: the smallest feasible "
            f"budget is {min_feasible_bytes} bytes ({min_feasible_bytes / _GIB:.2f} GiB) with "
            f"the least-memory option in every block; raise the budget or add cheaper options")


class PlanTooLarge(RuntimeError):
    """The exact search frontier outgrew `max_states` (see plan_budget for when this can happen)."""


def activation_peak(blocks: Sequence[BlockOptions], choice: Sequence[int]) -> int:
    """The activation peak of `choice` (option index per block), straight from the formula."""
    _check_choice(blocks, choice)
    return _peak(blocks, choice)


def plan_cost(blocks: Sequence[BlockOptions], choice: Sequence[int]) -> float:
    """Seconds `choice` adds to a step."""
    _check_choice(blocks, choice)
    return sum(block.options[index].cost_s for block, index in zip(blocks, choice))


def min_feasible_budget(blocks: Sequence[BlockOptions]) -> int:
    """The smallest activation peak any plan reaches (exact).

    Uses the suffix form of the peak (see plan_budget): M_i = max(K_i, s_i + M_{i+1}), M_N = 0,
    peak = M_0. M_i only grows with M_{i+1}, so the least M_i is the best option over the least
    M_{i+1}: one pass from the last block.
    """
    _validate(blocks)
    suffix = 0
    for block in reversed(blocks):
        suffix = min(max(block.peak_of(j), o.saved_bytes + suffix)
                     for j, o in enumerate(block.options))
    return suffix


def plan_budget(blocks: Sequence[BlockOptions], budget_bytes: int, *,
                max_states: int = 200_000) -> list[int]:
    """The cheapest plan whose activation peak is <= budget_bytes, as an option index per block.

    Ties: among plans of equal cost the lower peak wins, then the lexicographically smaller list of
    option indices. Costs are compared exactly (each float is a binary fraction, so all costs are
    scaled to integers over one common denominator); float rounding never decides a tie.

    Algorithm: dynamic programming from the last block to the first over Pareto frontiers.
    Define, for the suffix of blocks i..N-1 (s_i = saved bytes of block i's chosen option),

        M_i = max(K_i, s_i + M_{i+1}),  M_N = 0   (K_i and s_i of block i's chosen option).

    Unrolled, S_{<i} + M_i = max(S_total, max_{j>=i} (S_{<j} + K_j)): the peak terms of the
    suffix, each S_{<i} plus a quantity of the suffix alone; the whole peak is M_0 (S_{<0} = 0).
    So everything the blocks before i need to know
    about a suffix is the pair (M_i, suffix cost): its peak contribution is S_{<i} + M_i whatever
    the prefix, and its cost adds. A suffix (M, c) with another (M', c'), M' <= M and c' <= c, can
    be dropped: M_{i-1} = max(K, s + M) is non-decreasing in M and costs add, so every plan built
    on (M, c) is matched or beaten in both peak and cost by the same prefix on (M', c'). That is
    why pruning to the 2-D Pareto frontier is exact. A suffix is also dropped when even the
    smallest possible prefix (least saved bytes in every earlier block) pushes S_{<i} + M_i over
    the budget; no plan through it is feasible.

    The frontier only holds the optimum's value, not a plan, so the plan is rebuilt from the first
    block forward: take the lowest option index from which some frontier suffix still reaches the
    optimal (cost, peak). This makes the lexicographic tie-break exact, which back-pointers through
    pruned states would not (a pruned state can tie on the final cost and peak).

    Complexity: O(N * F * P * log(F * P)) time and O(N * F) memory, where P is options per block
    and F the largest frontier. F is at most the number of distinct M values under the budget,
    so at most budget / g + 1 where g is the gcd of all byte counts; for a model of a few repeated
    block kinds it is at most the number of ways to count options per kind, and equal sums of
    identical blocks collapse. Pathological: blocks whose bytes and costs trade off at distinct
    powers of two make every subset Pareto-optimal (F = 2^N); `PlanTooLarge` is raised when the
    frontier passes max_states rather than running for hours.
    """
    _validate(blocks)
    least = min_feasible_budget(blocks)  # >= 0, so a negative budget is infeasible like any other
    if budget_bytes < least:
        raise InfeasibleBudget(budget_bytes, least)
    costs = _exact_costs(blocks)
    frontiers = _suffix_frontiers(blocks, costs, budget_bytes, max_states)

    # frontiers[0] is ordered by M ascending with cost strictly descending, all with M_0 <= budget:
    # its last entry is the cheapest plan, and the lowest peak at that cost.
    best_peak = frontiers[0][0][-1]
    best_cost = frontiers[0][1][-1]
    return _rebuild(blocks, costs, frontiers, best_peak, best_cost)


def brute_force(blocks: Sequence[BlockOptions], budget_bytes: int) -> list[int] | None:
    """Every combination of options (for tests); None if none fits. Same ties as plan_budget."""
    _validate(blocks)
    costs = _exact_costs(blocks)
    best: tuple[int, int] | None = None
    best_choice: list[int] | None = None
    # product() yields choices in lexicographic order, so keeping the first strict minimum of
    # (cost, peak) also applies the lexicographic tie-break.
    for choice in itertools.product(*(range(len(b.options)) for b in blocks)):
        peak = _peak(blocks, choice)  # choices from product() are valid by construction
        if peak > budget_bytes:
            continue
        key = (sum(costs[i][o] for i, o in enumerate(choice)), peak)
        if best is None or key < best:
            best, best_choice = key, list(choice)
    return best_choice


def _peak(blocks: Sequence[BlockOptions], choice: Sequence[int]) -> int:
    held = 0  # S_{<i}
    peak = 0
    for block, index in zip(blocks, choice):
        peak = max(peak, held + block.peak_of(index))
        held += block.options[index].saved_bytes
    return max(peak, held)


def _suffix_frontiers(blocks: Sequence[BlockOptions], costs: list[list[int]], budget_bytes: int,
                      max_states: int) -> list[tuple[list[int], list[int]]]:
    """frontiers[i] = (M values ascending, costs strictly descending) over suffixes i..N-1;
    frontiers[N] is the empty suffix."""
    least_prefix = [0]  # least_prefix[i] = smallest possible S_{<i}
    for block in blocks:
        least_prefix.append(least_prefix[-1] + min(o.saved_bytes for o in block.options))

    frontiers: list[tuple[list[int], list[int]]] = [([0], [0])]
    for i in range(len(blocks) - 1, -1, -1):
        block = blocks[i]
        room = budget_bytes - least_prefix[i]  # M_i above this cannot fit under any prefix
        next_ms, next_costs = frontiers[-1]
        candidates: list[tuple[int, int]] = []
        for index, (option, option_cost) in enumerate(zip(block.options, costs[i])):
            k = block.peak_of(index)
            for m, c in zip(next_ms, next_costs):
                m_here = max(k, option.saved_bytes + m)
                if m_here > room:
                    break  # next_ms ascends, so the rest of this option's suffixes fail too
                candidates.append((m_here, c + option_cost))
        # Each option's run is already sorted by M, so this sort mostly merges runs.
        candidates.sort()
        ms: list[int] = []
        kept_costs: list[int] = []
        for m, c in candidates:
            if not kept_costs or c < kept_costs[-1]:
                ms.append(m)
                kept_costs.append(c)
        if len(ms) > max_states:
            raise PlanTooLarge(
                f"the exact plan search holds {len(ms)} states at block {block.name!r} "
                f"(limit {max_states}); blocks with many distinct sizes and costs make the search "
                f"exponential: round saved/peak bytes to a coarser unit or group similar blocks")
        frontiers.append((ms, kept_costs))
    frontiers.reverse()
    return frontiers


def _rebuild(blocks: Sequence[BlockOptions], costs: list[list[int]],
             frontiers: list[tuple[list[int], list[int]]], best_peak: int,
             best_cost: int) -> list[int]:
    """The lexicographically smallest choice reaching (best_cost, best_peak), block by block."""
    held = 0       # S_{<i} of the choice so far
    peak_so_far = 0
    cost_so_far = 0
    choice: list[int] = []
    for i, block in enumerate(blocks):
        next_ms, next_costs = frontiers[i + 1]
        for index, option in enumerate(block.options):
            peak_here = max(peak_so_far, held + block.peak_of(index))
            held_after = held + option.saved_bytes
            cost_after = cost_so_far + costs[i][index]
            # The cheapest suffix whose M keeps the peak within best_peak (costs descend with M).
            last = bisect_right(next_ms, best_peak - held_after) - 1
            if peak_here <= best_peak and last >= 0 and cost_after + next_costs[last] <= best_cost:
                choice.append(index)
                held, peak_so_far, cost_so_far = held_after, peak_here, cost_after
                break
        else:
            raise AssertionError(f"planner lost the optimum at block {block.name!r}")
    return choice


def _exact_costs(blocks: Sequence[BlockOptions]) -> list[list[int]]:
    """Each cost_s as an integer numerator over one shared denominator (exact for floats)."""
    ratios = [[float(o.cost_s).as_integer_ratio() for o in b.options] for b in blocks]
    denominator = math.lcm(*(d for row in ratios for _, d in row))
    return [[n * (denominator // d) for n, d in row] for row in ratios]


def _validate(blocks: Sequence[BlockOptions]) -> None:
    for block in blocks:
        if not block.options:
            raise ValueError(f"block {block.name!r} has no options")
        if block.peak_bytes < 0:
            raise ValueError(f"block {block.name!r}: peak_bytes={block.peak_bytes} must be >= 0")
        for o in block.options:
            if o.peak_bytes is not None and o.peak_bytes < 0:
                raise ValueError(f"block {block.name!r} option {o.name!r}: "
                                 f"peak_bytes={o.peak_bytes} must be >= 0")
            if o.saved_bytes < 0:
                raise ValueError(f"block {block.name!r} option {o.name!r}: "
                                 f"saved_bytes={o.saved_bytes} must be >= 0")
            if not (math.isfinite(o.cost_s) and o.cost_s >= 0):
                raise ValueError(f"block {block.name!r} option {o.name!r}: "
                                 f"cost_s={o.cost_s} must be a finite number >= 0")


def _check_choice(blocks: Sequence[BlockOptions], choice: Sequence[int]) -> None:
    if len(choice) != len(blocks):
        raise ValueError(f"choice has {len(choice)} entries for {len(blocks)} blocks")
    for block, index in zip(blocks, choice):
        if not 0 <= index < len(block.options):
            raise ValueError(f"block {block.name!r} has no option {index}")
