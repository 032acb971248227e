"""`checkpointing=file`: carry out a per-block plan an earlier run wrote (its plan.json)."""

from __future__ import annotations

import json
from dataclasses import fields
from typing import Sequence

from checkpointing.plan import BlockPlan, block_rows
from trainer.config import ConfigError

_ALLOWED = {"recompute": ("none", "full", "selective", "compiler"), "offload": ("none", "inputs", "all"),
            "target": ("cpu", "disk")}


def read_plan(path: str, names: Sequence[str], shard: bool, compiled: bool) -> list[BlockPlan]:
    """The plan in `path` for these blocks (same names, same order); `shard` follows this run's
    sharding, since the file's was the earlier run's. compiled: train.compile is on, which
    blocks the compiler places recompute in (recompute "compiler") need."""
    key = "checkpointing.plan_file"
    try:
        with open(path) as f:
            rows = json.load(f)
    except (OSError, ValueError) as exc:
        raise ConfigError(key, f"cannot read {path}: {exc}") from None
    if not isinstance(rows, list) or not all(isinstance(r, dict) for r in rows):
        raise ConfigError(key, f"{path} is not a plan.json (a list of blocks)")
    rows = block_rows(rows)  # the loss head's row: checkpointing.head decides it
    if [r.get("name") for r in rows] != list(names):
        raise ConfigError(key, f"{path} plans {len(rows)} blocks "
                          f"({', '.join(str(r.get('name')) for r in rows[:3])}, ...) but this "
                          f"model has {len(names)} ({', '.join(names[:3])}, ...)")
    known = {f.name for f in fields(BlockPlan)}
    plan = []
    for index, row in enumerate(rows):
        for field, allowed in _ALLOWED.items():
            if row.get(field, allowed[0]) not in allowed:
                raise ConfigError(key, f"{path}, block {row['name']}: {field}="
                                  f"{row.get(field)!r}; choose one of {', '.join(allowed)}")
        if row.get("recompute") == "compiler":
            budget = row.get("memory_budget")
            if not isinstance(budget, (int, float)) or not 0 <= budget <= 1:
                raise ConfigError(key, f"{path}, block {row['name']}: recompute=compiler needs "
                                  f"memory_budget between 0 and 1, got {budget!r}")
            if not compiled:
                raise ConfigError("train.compile", f"{path} leaves block {row['name']}'s "
                                  "recompute to the compiler: set train.compile=true")
        tiles = row.get("tiles", 1)
        if isinstance(tiles, bool) or not isinstance(tiles, int) or tiles < 1:
            raise ConfigError(key, f"{path}, block {row['name']}: tiles={tiles!r}; an integer "
                              ">= 1 (1: the MLP whole)")
        values = {k: v for k, v in row.items() if k in known}
        plan.append(BlockPlan(**{**values, "index": index, "shard": shard}))
    return plan
