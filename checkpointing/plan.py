"""The per-block plan: every memory decision for every block, as data.

Policies are functions from the blocks to a list of BlockPlan; the wrappers in checkpointing/,
offload/ and sharding/ only carry a plan out. A plan can be printed, saved and tested before any
model is materialised.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from typing import Literal, Sequence

Recompute = Literal["none", "full", "selective"]
Offload = Literal["none", "inputs", "all"]
Target = Literal["cpu", "disk"]


@dataclass(frozen=True)
class BlockPlan:
    index: int
    name: str
    recompute: Recompute = "none"
    offload: Offload = "none"
    target: Target = "cpu"
    shard: bool = True


def make_plan(block_names: Sequence[str], policy: str, shard: bool) -> list[BlockPlan]:
    """One BlockPlan per block for `checkpointing.policy`.

    shard: whether blocks are fully_shard-ed (False for sharding=none).
    """
    if policy != "none":
        raise ValueError(f"checkpointing.policy={policy!r} is not available; choose none")
    return [BlockPlan(index=i, name=name, shard=shard) for i, name in enumerate(block_names)]


def plan_to_json(plan: Sequence[BlockPlan]) -> str:
    return json.dumps([asdict(p) for p in plan], indent=1)


def describe(plan: Sequence[BlockPlan]) -> str:
    """A compact one-line summary, e.g. '4 blocks: recompute none x4; offload none x4; sharded'."""
    def counts(attr: str) -> str:
        values: dict[str, int] = {}
        for p in plan:
            values[str(getattr(p, attr))] = values.get(str(getattr(p, attr)), 0) + 1
        return ", ".join(f"{v} x{n}" for v, n in values.items())

    sharded = sum(p.shard for p in plan)
    return (f"{len(plan)} blocks: recompute {counts('recompute')}; offload {counts('offload')}; "
            f"sharded {sharded}/{len(plan)}")
