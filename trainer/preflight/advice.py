"""What would make a step fit: single changes to the configuration, each predicted in full.

Tried in order: checkpointing=full, checkpointing=selective, a smaller micro-batch with more
gradient accumulation (same global batch), sharding over more ranks (whole nodes, same per-rank
micro-batch), sharding.param_dtype=bfloat16. Plan and world changes reuse the meta profile; a
new micro-batch or dtype is traced once on meta.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional

from checkpointing.planner.policies import BudgetError
from trainer.preflight.scenario import Evaluator, Outcome, Scenario, with_changes
from trainer.config import ConfigError

# Sharding over more ranks is searched up to this many nodes; beyond it, say it cannot help.
MAX_NODES = 4096


@dataclass(frozen=True)
class Suggestion:
    change: str  # what to add to the command line
    outcome: Outcome
    fits: bool


def _try(evaluator: Evaluator, make: Callable[[], Scenario]) -> Optional[Outcome]:
    """The outcome of a candidate, or None when the trainer would refuse it."""
    try:
        return evaluator.evaluate(make())
    except (BudgetError, ConfigError):
        return None


def suggest(evaluator: Evaluator, base: Scenario, capacity: int) -> list[Suggestion]:
    """Every candidate change that the trainer would accept, with its prediction."""
    found: list[Suggestion] = []

    def add(change: str, outcome: Optional[Outcome]) -> None:
        if outcome is not None:
            found.append(Suggestion(change, outcome, outcome.estimate.peak.total <= capacity))

    policy = base.cfg.checkpointing.policy
    for option in ("full", "selective"):
        if policy != option:
            add(f"checkpointing={option}", _try(evaluator, lambda o=option: with_changes(
                base, checkpointing={"policy": o, "budget": None})))
    add_micro_batch(evaluator, base, capacity, add)
    add_more_ranks(evaluator, base, capacity, add)
    s = base.cfg.sharding
    if s.mode != "none" and s.param_dtype != "bfloat16":
        add("sharding.param_dtype=bfloat16 sharding.reduce_dtype=float32",
            _try(evaluator, lambda: with_changes(
                base, sharding={"param_dtype": "bfloat16", "reduce_dtype": "float32"})))
    if s.mode != "none" and not s.cpu_offload:
        # Parameters, gradients and optimizer state in host memory; the optimizer steps there.
        add("sharding.cpu_offload=true", _try(evaluator, lambda: with_changes(
            base, sharding={"cpu_offload": True})))
    return found


def add_micro_batch(evaluator: Evaluator, base: Scenario, capacity: int,
                    add: Callable[[str, Optional[Outcome]], None]) -> None:
    """The largest smaller micro-batch that fits (dividing the current one, so the global
    batch stays), else the smallest tried."""
    t = base.cfg.train
    last: Optional[tuple[str, Optional[Outcome]]] = None
    for smaller in range(t.micro_batch_size - 1, 0, -1):
        if t.micro_batch_size % smaller:
            continue
        changes = {"micro_batch_size": smaller}
        if t.global_batch_size is None:  # else the trainer derives grad_accum itself
            changes["grad_accum"] = base.layout.grad_accum * (t.micro_batch_size // smaller)
        text = " ".join(f"train.{k}={v}" for k, v in changes.items())
        outcome = _try(evaluator, lambda c=changes: with_changes(base, train=c))
        last = (text, outcome)
        if outcome is not None and outcome.estimate.peak.total <= capacity:
            break
    if last is not None:
        add(*last)


def add_more_ranks(evaluator: Evaluator, base: Scenario, capacity: int,
                   add: Callable[[str, Optional[Outcome]], None]) -> None:
    """The fewest whole nodes whose shard group makes the step fit.

    Per-rank memory falls as the shard group grows (parameters, gradients and optimizer state
    shrink; activations and unsharded transients stay), so the search doubles, then bisects.
    HSDP with the default replicate (one group per node) shards within a node, so more nodes do
    not help it; sharding=none does not shard at all.
    """
    s = base.cfg.sharding
    if s.mode == "none" or (s.mode == "hsdp" and s.replicate is None):
        return
    per_node = base.gpus_per_node
    nodes = base.layout.world_size // per_node

    def outcome_for(count: int) -> Optional[Outcome]:
        # The global batch grows with the world; keep this rank's micro-batches as they are.
        return _try(evaluator, lambda: with_changes(
            base, world_size=count * per_node, nodes=count,
            train={"global_batch_size": None, "grad_accum": base.layout.grad_accum}))

    def fits(count: int) -> bool:
        outcome = outcome_for(count)
        return outcome is not None and outcome.estimate.peak.total <= capacity

    high = nodes + 1
    while high <= MAX_NODES and not fits(high):
        high *= 2
    if high > MAX_NODES:
        return
    low = max(nodes, high // 2)  # does not fit (or is the current size)
    while high - low > 1:
        middle = (low + high) // 2
        low, high = (low, middle) if fits(middle) else (middle, high)
    add(f"--world-size {high * per_node} --nodes {high}", outcome_for(high))
