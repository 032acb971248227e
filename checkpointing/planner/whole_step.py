"""`checkpointing=auto`: the fastest per-block plan whose whole step fits a memory capacity.

One memory model decides: checkpointing/planner/memory.py's fixed part of every phase
(parameters, gradients, optimizer state, FSDP transients, the head, optimizer temporaries) plus
the activation chain, turned into the search's chain by `capacity_chain`. The search
(checkpointing/planner/search.py) then returns the plan with the least added seconds whose
predicted peak is within the capacity; `estimate` of that plan gives the same peak, which is what
a caller shows and checks.

Time comes from measurements the caller makes (checkpointing/planner/profile.py on the device) or
from FLOPs at a nominal rate (the pre-flight report): `Timing`. Pure arithmetic over those numbers.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Optional, Sequence

from checkpointing.planner.memory import (Estimate, ParamGroup, Setup, capacity_chain, estimate,
                                  fixed_phases, moved_bytes)
from checkpointing.planner.metatrace import MetaProfile
from checkpointing.plan import BlockPlan, make_plan
from checkpointing.planner.search import activation_peak, min_feasible_budget, plan_budget
from checkpointing.planner.policies import CHOICES, OffloadCost, block_options
from checkpointing.planner.profile import BlockProfile


@dataclass(frozen=True)
class Timing:
    """Seconds of one micro-batch."""

    block_cost: tuple[dict[str, float], ...]  # per block: seconds each recompute option adds
    block_compute: tuple[float, ...]  # per block: forward + backward as it is
    rest_s: float  # everything outside the blocks (embedding, head, loss, optimizer share)
    offload_s_per_byte: Optional[float] = None  # out and back again; None: no offload option


@dataclass(frozen=True)
class Choice:
    plan: list[BlockPlan]
    estimate: Estimate
    step_s: float  # predicted seconds per optimizer step (all micro-batches)

    @property
    def peak(self) -> int:
        return self.estimate.peak.total


class NoFit(ValueError):
    """No plan fits the capacity; `least` is the smallest capacity that one plan fits."""

    def __init__(self, capacity: int, least: int) -> None:
        self.capacity, self.least = capacity, least
        super().__init__(f"no plan fits {capacity} bytes; the least is {least} bytes")


def step_seconds(plan: Sequence[BlockPlan], profile: MetaProfile, setup: Setup,
                 timing: Timing) -> float:
    """Predicted seconds per optimizer step of `plan`: every micro-batch's blocks as they are,
    their recompute, offload transfers a block's own compute cannot hide, and the rest."""
    per_micro = timing.rest_s
    for step, measure, cost, compute in zip(plan, profile.blocks, timing.block_cost,
                                            timing.block_compute, strict=True):
        per_micro += compute + cost[step.recompute]
        if step.offload != "none" and setup.offload_min_bytes is not None:
            moved = moved_bytes(measure, step, setup.offload_min_bytes)
            per_micro += max(0.0, moved * (timing.offload_s_per_byte or 0.0) - compute)
    return per_micro * setup.grad_accum


def evaluate_plan(groups: Sequence[ParamGroup], profile: MetaProfile, setup: Setup,
                  timing: Timing, plan: list[BlockPlan]) -> Choice:
    return Choice(plan, estimate(groups, profile, plan, setup),
                  step_seconds(plan, profile, setup, timing))


def fastest_plan(groups: Sequence[ParamGroup], profile: MetaProfile, setup: Setup,
                 timing: Timing, capacity: int, shard: bool, keep_last: int,
                 target: str = "cpu") -> Choice:
    """The plan with the least predicted step time whose predicted peak is <= capacity.

    Options per block are the budget planner's (checkpointing/planner/policies.block_options):
    recompute none / selective / full and, when `setup` moves offloaded tensors, none or full offloaded to
    `target` (not for the last `keep_last` blocks). Raises NoFit naming the least capacity.
    """
    fixed = fixed_phases(groups, profile, setup)
    profiles = [BlockProfile(saved_bytes=dict(m.saved_bytes), cost_s=dict(cost),
                             compute_s=compute, storage_sizes=dict(m.storage_sizes),
                             working_bytes=dict(m.peak_bytes))
                for m, cost, compute in zip(profile.blocks, timing.block_cost,
                                            timing.block_compute, strict=True)]
    offload = None
    if setup.offload_min_bytes is not None:
        offload = OffloadCost(target, timing.offload_s_per_byte or 0.0, setup.offload_min_bytes,
                              keep_last)
    blocks = block_options(profile.block_names, profiles, offload, fold_prefetch=False)
    chain, floor = capacity_chain(fixed, profile, blocks)
    least = max(floor, min_feasible_budget(chain))
    if least > capacity:
        raise NoFit(capacity, least)
    picked = plan_budget(chain, capacity)
    names = [blocks[i].options[index].name for i, index in enumerate(picked[1:-1])]
    plan = make_plan(list(profile.block_names), [CHOICES[n][0] for n in names], shard)
    plan = [replace(p, offload=CHOICES[n][1], target=target) if CHOICES[n][1] != "none" else p
            for p, n in zip(plan, names)]
    choice = evaluate_plan(groups, profile, setup, timing, plan)
    # The planner's peak bounds the model's: equal without offload; with it, above by what the
    # next block's largest working set over-counts (memory.capacity_chain).
    planned = max(floor, activation_peak(chain, picked))
    assert choice.peak <= planned <= capacity, (choice.peak, planned, capacity)
    return choice
