"""The per-block plan: every memory decision for every block, as data.

Policies are functions from the blocks to a list of BlockPlan; the wrappers in checkpointing/,
offload/ and sharding/ only carry a plan out. A plan can be printed, saved and tested before any
model is materialised.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, replace
from typing import Literal, Optional, Sequence

Recompute = Literal["none", "full", "selective", "compiler"]
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
    # recompute="compiler": torch.compile's partitioner chooses what to keep, under this
    # activation_memory_budget (0: keep only the block's inputs, 1: its default choice).
    memory_budget: Optional[float] = None
    # Sequence tiles the block's MLP is computed and recomputed in (checkpointing/tiles.py):
    # 1 leaves it whole.
    tiles: int = 1


POLICIES = ("none", "full", "every_k", "sqrt", "selective", "budget", "compiler")

# Ops whose outputs selective checkpointing keeps by default (aten names, resolved to ops in
# checkpointing/wrap.py): matmuls and attention, the work that is expensive to redo. Everything
# else (norms, activations, rotary, dropout) is recomputed, and so is a listed op whenever a
# call of it draws random numbers (attention with dropout on: see wrap.keeps). Here, without
# torch, so the config schema (trainer/config.py) can use the same list.
DEFAULT_SAVE_OPS = (
    "mm", "addmm", "bmm", "baddbmm",
    "_scaled_dot_product_flash_attention", "_scaled_dot_product_efficient_attention",
    "_scaled_dot_product_cudnn_attention", "_scaled_dot_product_flash_attention_for_cpu",
)


def sqrt_interval(num_blocks: int) -> int:
    return max(1, math.ceil(math.sqrt(num_blocks)))


def recompute_pattern(policy: str, num_blocks: int, every: int = 1) -> list[Recompute]:
    """What each block recomputes under a fixed (profile-free) policy.

    every_k: recompute every k-th block (blocks 0, k, 2k, ...), keep the rest.
    sqrt: the per-block form of the sqrt(N) schedule: only ~sqrt(N) evenly spaced blocks keep
      their activations (every k-th with k = ceil(sqrt N)), all others recompute. Activation
      memory is then O(sqrt N) blocks' worth plus one input per recomputed block, for about one
      extra forward.
    """
    if policy == "none":
        return ["none"] * num_blocks
    if policy == "full":
        return ["full"] * num_blocks
    if policy == "selective":
        return ["selective"] * num_blocks
    if policy == "every_k":
        return ["full" if i % every == 0 else "none" for i in range(num_blocks)]
    if policy == "sqrt":
        k = sqrt_interval(num_blocks)
        return ["none" if i % k == k - 1 else "full" for i in range(num_blocks)]
    raise ValueError(f"checkpointing.policy={policy!r} needs profiles; choose one of "
                     f"{', '.join(POLICIES)}")


def make_plan(block_names: Sequence[str], recompute: Sequence[Recompute],
              shard: bool) -> list[BlockPlan]:
    """One BlockPlan per block. shard: whether blocks are fully_shard-ed (False: sharding=none)."""
    return [BlockPlan(index=i, name=name, recompute=r, shard=shard)
            for i, (name, r) in enumerate(zip(block_names, recompute, strict=True))]


def with_offload(plan: Sequence[BlockPlan], target: str, keep_last: int) -> list[BlockPlan]:
    """`offload=cpu|disk` for fixed policies: every block but the last `keep_last` moves what it
    keeps for backward: its checkpoint inputs when it recomputes, everything when it keeps all.
    The last blocks run backward first, so moving them out would only make backward wait."""
    if target == "none":
        return list(plan)
    cut = len(plan) - keep_last
    return [replace(p, offload=("all" if p.recompute in ("none", "compiler") else "inputs"),
                    target=target)
            if p.index < cut else p for p in plan]


def with_tiles(plan: Sequence[BlockPlan], tiles: int) -> list[BlockPlan]:
    """`checkpointing.tiles=N` for every block: each block's MLP computed and recomputed in N
    sequence tiles (checkpointing/tiles.py). A plan file's and a planner's plans carry their
    own per block."""
    if isinstance(tiles, bool) or not isinstance(tiles, int) or tiles < 1:
        raise ValueError(f"tiles must be an integer >= 1, got {tiles!r}")
    return [replace(p, tiles=tiles) for p in plan]


def plan_to_json(plan: Sequence[BlockPlan], head: Optional[dict] = None) -> str:
    """plan.json: a row per block, then (when given) the loss head's row, `{"name": "head",
    "head": "plain" | "chunked", "chunk_tokens": ...}`, which `checkpointing=file` skips."""
    return json.dumps([asdict(p) for p in plan] + ([head] if head else []), indent=1)


def block_rows(rows: Sequence[dict]) -> list[dict]:
    """The blocks' rows of a plan.json (without the loss head's)."""
    return [r for r in rows if "head" not in r]


def plan_from_json(text: str) -> list[BlockPlan]:
    return [BlockPlan(**r) for r in block_rows(json.loads(text))]


# The loss head's default budget: fp32 logits of one chunk (checkpointing.head_budget_mib's 256).
DEFAULT_HEAD_BUDGET_BYTES = 256 * 2**20


def default_chunk_tokens(vocab: int, budget_bytes: int = DEFAULT_HEAD_BUDGET_BYTES) -> int:
    """Tokens per chunk of the fused chunked head (checkpointing/head.py): the most whose fp32
    logits ([tokens, vocab]) fit `budget_bytes`; at least 1. Here, without torch, so the
    trainer's task and the head share one formula.

    The chunk's working set is then the budget for an fp32 head, 1.5 times it for bf16 (the fp32
    logits and their gradient cast to bf16)."""
    if vocab <= 0 or budget_bytes <= 0:
        raise ValueError(f"vocab ({vocab}) and budget_bytes ({budget_bytes}) must be positive")
    return max(1, budget_bytes // (vocab * 4))


def head_row(head: str, chunk_tokens: Optional[int]) -> dict:
    """The loss head's row of the plan (table, plan.json, W&B)."""
    return {"name": "head", "head": head, "chunk_tokens": chunk_tokens}


def head_table_row(row: dict, like: dict, index: int) -> dict:
    """The head's row in the blocks' columns (a W&B table needs them all): its choice where a
    block has its recompute option."""
    choice = (f"{row['head']} head" + (f", {row['chunk_tokens']} tokens per chunk"
                                       if row["head"] == "chunked" else ""))
    return {**{key: None for key in like}, "index": index, "name": "head", "recompute": choice}


def head_line(row: dict) -> str:
    if row["head"] == "chunked":
        return (f"{'':>5} {'head':<24} chunked: fused linear cross-entropy, {row['chunk_tokens']:,} "
                "tokens per chunk (never the whole logits)")
    return f"{'':>5} {'head':<24} plain: logits, then cross-entropy"


def plan_rows(plan: Sequence[BlockPlan], profiles: Optional[Sequence] = None) -> list[dict]:
    """One dict per block: the plan, plus profiled bytes and seconds of its choice if known."""
    rows = []
    for i, p in enumerate(plan):
        row = asdict(p)
        if profiles is not None:
            # The compiler's own choice is not profiled: its bytes are measured while training.
            row["saved_bytes"] = profiles[i].saved_bytes.get(p.recompute)
            row["recompute_s"] = profiles[i].cost_s.get(p.recompute)
        rows.append(row)
    return rows


def plan_table(plan: Sequence[BlockPlan], profiles: Optional[Sequence] = None) -> str:
    """The plan as a terminal table (printed at start)."""
    rows = plan_rows(plan, profiles)
    tiled = any(p.tiles > 1 for p in plan)  # the column only when some block has tiles
    header = f"{'block':>5} {'name':<24} {'recompute':<10} {'offload':<8} {'shard':<5}"
    if tiled:
        header += f" {'tiles':>5}"
    if profiles is not None:
        header += f" {'saved MiB':>10} {'recompute ms':>12}"
    lines = [header]
    for r in rows:
        line = (f"{r['index']:>5} {r['name']:<24} {r['recompute']:<10} {r['offload']:<8} "
                f"{str(r['shard']):<5}")
        if tiled:
            line += f" {r['tiles']:>5}"
        if profiles is not None and r["saved_bytes"] is not None:
            line += f" {r['saved_bytes'] / 2**20:>10.2f} {r['recompute_s'] * 1e3:>12.2f}"
        elif r["memory_budget"] is not None:
            line += f"   compiler's activation_memory_budget {r['memory_budget']:.3f}"
        lines.append(line)
    return "\n".join(lines)


def describe(plan: Sequence[BlockPlan]) -> str:
    """A compact one-line summary, e.g. '4 blocks: recompute none x4; offload none x4; sharded'."""
    def counts(attr: str) -> str:
        values: dict[str, int] = {}
        for p in plan:
            values[str(getattr(p, attr))] = values.get(str(getattr(p, attr)), 0) + 1
        return ", ".join(f"{v} x{n}" for v, n in values.items())

    sharded = sum(p.shard for p in plan)
    tiles = f"; tiles {counts('tiles')}" if any(p.tiles > 1 for p in plan) else ""
    return (f"{len(plan)} blocks: recompute {counts('recompute')}; offload {counts('offload')}"
            f"{tiles}; sharded {sharded}/{len(plan)}")

