"""Choosing the plan: fixed policies by pattern, `budget` by the exact planner over profiles."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence

from checkpointing.plan import BlockPlan, make_plan, recompute_pattern
from checkpointing.planner import BlockOptions, InfeasibleBudget, Option, plan_budget
from checkpointing.profile import OPTIONS, BlockProfile


class BudgetError(ValueError):
    """checkpointing.budget cannot be met; the message names the smallest feasible budget."""


@dataclass(frozen=True)
class Budget:
    bytes: int  # for the whole step's activations, per rank
    no_checkpoint_bytes: int  # the same without any checkpointing, for reference


def resolve_budget(budget: float, profiles: Sequence[BlockProfile], rest_bytes: int) -> Budget:
    """checkpointing.budget: bytes (> 1) or a fraction (<= 1) of the no-checkpoint activations."""
    keep_all = rest_bytes + sum(p.saved_bytes["none"] for p in profiles)
    value = int(budget * keep_all) if budget <= 1 else int(budget)
    return Budget(bytes=value, no_checkpoint_bytes=keep_all)


def block_options(names: Sequence[str], profiles: Sequence[BlockProfile]) -> list[BlockOptions]:
    return [BlockOptions(name=name, peak_bytes=p.peak_bytes,
                         options=tuple(Option(o, p.saved_bytes[o], p.cost_s[o]) for o in OPTIONS))
            for name, p in zip(names, profiles, strict=True)]


def choose_plan(policy: str, block_names: Sequence[str], shard: bool, every: int = 2,
                profiles: Optional[Sequence[BlockProfile]] = None, rest_bytes: int = 0,
                budget: Optional[Budget] = None) -> list[BlockPlan]:
    if policy != "budget":
        return make_plan(block_names, recompute_pattern(policy, len(block_names), every), shard)
    assert profiles is not None and budget is not None, "the budget policy needs profiles"
    blocks = block_options(block_names, profiles)
    try:
        choice = plan_budget(blocks, budget.bytes - rest_bytes)
    except InfeasibleBudget as exc:
        smallest = rest_bytes + exc.min_feasible_bytes
        raise BudgetError(
            f"{budget.bytes} bytes ({budget.bytes / 2**30:.3f} GiB) cannot "
            f"be met: the smallest feasible budget is {smallest} bytes "
            f"({smallest / 2**30:.3f} GiB; {rest_bytes} of it outside the blocks); without "
            f"checkpointing the step keeps {budget.no_checkpoint_bytes} bytes") from exc
    recompute = [blocks[i].options[c].name for i, c in enumerate(choice)]
    return make_plan(block_names, recompute, shard)


def added_seconds(plan: Sequence[BlockPlan], profiles: Sequence[BlockProfile]) -> float:
    """Predicted recompute seconds per micro-batch for this plan."""
    return sum(p.cost_s[b.recompute] for b, p in zip(plan, profiles, strict=True))


def predicted_saved_bytes(plan: Sequence[BlockPlan], profiles: Sequence[BlockProfile],
                          rest_bytes: int) -> int:
    """Activation bytes kept at the end of a micro-batch's forward under this plan."""
    return rest_bytes + sum(p.saved_bytes[b.recompute] for b, p in zip(plan, profiles, strict=True))
