"""Choosing the plan: fixed policies by pattern, `budget` by the exact planner over profiles."""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Optional, Sequence

from checkpointing.plan import BlockPlan, make_plan, recompute_pattern
from checkpointing.planner.search import BlockOptions, InfeasibleBudget, Option, plan_budget
from checkpointing.planner.profile import OPTIONS, BlockProfile


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


@dataclass(frozen=True)
class OffloadCost:
    """What the planner needs to cost offload as a per-block option."""

    target: str  # cpu | disk
    seconds_per_byte: float  # measured: out and back again
    min_bytes: int  # smaller storages stay on the device
    keep_last: int  # the last blocks are never offloaded


# Planner option name -> (recompute, offload) of the BlockPlan it becomes.
CHOICES = {"none": ("none", "none"), "selective": ("selective", "none"), "full": ("full", "none"),
           "none+offload": ("none", "all"), "full+offload": ("full", "inputs"),
           "compiler": ("compiler", "none")}


def block_options(names: Sequence[str], profiles: Sequence[BlockProfile],
                  offload: Optional[OffloadCost] = None,
                  fold_prefetch: bool = True) -> list[BlockOptions]:
    """Each block's options with saved device bytes, added seconds and working set.

    Offloading costs the transfer time the block's own forward and backward cannot hide
    (transfers run beside compute); the bytes that stay are the storages under min_bytes.
    While the next block's backward runs, the engine already brings an offloaded block back
    (one block ahead), so then all it saved is on the device beside that block's working set:
    fold_prefetch counts this in the offload option's own K, with the next block's largest
    working set (checkpointing/planner/memory.py's capacity_chain folds it with the phases instead).
    """
    out = []
    for index, (name, p) in enumerate(zip(names, profiles, strict=True)):
        # Under compile the compiler's own placement may be profiled as a fourth option.
        options = [Option(o, p.saved_bytes[o], p.cost_s[o], p.peak_of(o))
                   for o in (*OPTIONS, "compiler") if o in p.saved_bytes]
        if offload is not None and index < len(names) - offload.keep_last:
            ahead = (max(profiles[index + 1].peak_of(o) for o in OPTIONS)
                     if fold_prefetch and index + 1 < len(names) else 0)
            for recompute in ("none", "full"):
                stay = p.small_bytes(recompute, offload.min_bytes)
                moved = p.saved_bytes[recompute] - stay
                exposed = max(0.0, moved * offload.seconds_per_byte - p.compute_s)
                options.append(Option(f"{recompute}+offload", stay, p.cost_s[recompute] + exposed,
                                      max(p.peak_of(recompute), p.saved_bytes[recompute] + ahead)))
        out.append(BlockOptions(name=name, peak_bytes=p.peak_bytes, options=tuple(options)))
    return out


def compiler_budgets(profiles: Sequence[BlockProfile], budget: Budget,
                     rest_bytes: int) -> list[float]:
    """checkpointing=compiler: each block's activation_memory_budget for torch.compile's
    partitioner, so that the blocks keep the same share of their no-checkpoint bytes as
    `budget` allows in all.

    The partitioner's budget r is linear in its own byte estimate: r=0 keeps only the graph's
    inputs, r=1 what its default min-cut keeps; parameters are inputs at both ends and cancel.
    With profiles measured under compile, a block's full-recompute bytes (its inputs) and no-
    checkpoint bytes are those two ends, so r = (target - full) / (none - full).
    """
    none = sum(p.saved_bytes["none"] for p in profiles)
    least = rest_bytes + sum(p.saved_bytes["full"] for p in profiles)
    if budget.bytes < least:
        raise BudgetError(
            f"{budget.bytes} bytes ({budget.bytes / 2**30:.3f} GiB) cannot be met: the smallest "
            f"feasible budget is {least} bytes ({least / 2**30:.3f} GiB: every block keeping only "
            f"its inputs, {rest_bytes} of it outside the blocks); without checkpointing the step "
            f"keeps {budget.no_checkpoint_bytes} bytes")
    share = (budget.bytes - rest_bytes) / none if none else 1.0
    budgets = []
    for p in profiles:
        keep_all, inputs = p.saved_bytes["none"], p.saved_bytes["full"]
        span = keep_all - inputs
        ratio = (share * keep_all - inputs) / span if span > 0 else 1.0
        budgets.append(round(min(1.0, max(0.0, ratio)), 4))
    return budgets


def choose_plan(policy: str, block_names: Sequence[str], shard: bool, every: int = 2,
                profiles: Optional[Sequence[BlockProfile]] = None, rest_bytes: int = 0,
                budget: Optional[Budget] = None,
                offload: Optional[OffloadCost] = None) -> list[BlockPlan]:
    if policy == "compiler":
        assert profiles is not None and budget is not None, "the compiler policy needs profiles"
        return [replace(p, memory_budget=r) for p, r in zip(
            make_plan(block_names, ["compiler"] * len(block_names), shard),
            compiler_budgets(profiles, budget, rest_bytes), strict=True)]
    if policy != "budget":
        return make_plan(block_names, recompute_pattern(policy, len(block_names), every), shard)
    assert profiles is not None and budget is not None, "the budget policy needs profiles"
    blocks = block_options(block_names, profiles, offload)
    try:
        choice = plan_budget(blocks, budget.bytes - rest_bytes)
    except InfeasibleBudget as exc:
        smallest = rest_bytes + exc.min_feasible_bytes
        raise BudgetError(
            f"{budget.bytes} bytes ({budget.bytes / 2**30:.3f} GiB) cannot "
            f"be met: the smallest feasible budget is {smallest} bytes "
            f"({smallest / 2**30:.3f} GiB; {rest_bytes} of it outside the blocks); without "
            f"checkpointing the step keeps {budget.no_checkpoint_bytes} bytes") from exc
    names = [blocks[i].options[c].name for i, c in enumerate(choice)]
    plan = [replace(p, memory_budget=profiles[p.index].compiler_budget)
            if p.recompute == "compiler" else p
            for p in make_plan(block_names, [CHOICES[n][0] for n in names], shard)]
    return [replace(p, offload=CHOICES[n][1], target=offload.target) if CHOICES[n][1] != "none"
            else p for p, n in zip(plan, names)]


def added_seconds(plan: Sequence[BlockPlan], profiles: Sequence[BlockProfile]) -> float:
    """Profiled recompute seconds per micro-batch for this plan."""
    return sum(p.cost_s[b.recompute] for b, p in zip(plan, profiles, strict=True))


def predicted_saved_bytes(plan: Sequence[BlockPlan], profiles: Sequence[BlockProfile],
                          rest_bytes: int, min_bytes: int = 0) -> int:
    """Activation bytes kept on the device at the end of a micro-batch's forward."""
    total = rest_bytes
    for b, p in zip(plan, profiles, strict=True):
        offloaded = b.offload != "none"
        total += p.small_bytes(b.recompute, min_bytes) if offloaded else p.saved_bytes[b.recompute]
    return total
