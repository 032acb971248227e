"""The sizes sequence parallelism needs, as pure checks: a config validator runs them before any
process group starts, and without torch (trainer/validate.py imports this module).

  kv_repeats        how often each key/value head is repeated so N ranks can split the heads
  check_degree      N divides the sequence
  check_mesh_sizes  a sequence group of N fits the sharding mode and the world
"""

from __future__ import annotations

import math


def kv_repeats(q_heads: int, kv_heads: int, degree: int) -> int:
    """How many times each key/value head is repeated so `degree` ranks can split the heads.

    Supported: `degree` divides the query heads, and the query heads are a multiple of the KV
    heads (any grouped-query or multi-query model). Then:
      * degree divides kv_heads: 1, no repeat (each rank takes kv_heads/degree KV heads);
      * otherwise: degree / gcd(degree, kv_heads), the least repeat making the KV heads a
        multiple of degree; it always divides the group size q_heads/kv_heads, so query head h
        still meets (a copy of) its own KV head h // (q_heads/kv_heads) after the split.
    Refused (ValueError): degree not dividing the query heads.
    """
    if degree < 1:
        raise ValueError(f"sequence degree must be >= 1, got {degree}")
    if kv_heads < 1 or q_heads % kv_heads:
        raise ValueError(f"query heads {q_heads} must be a multiple of the KV heads {kv_heads}")
    if q_heads % degree:
        raise ValueError(f"sequence degree {degree} must divide the attention heads {q_heads}: "
                         f"each rank attends with heads/degree of them")
    return degree // math.gcd(degree, kv_heads)


def check_degree(seq_len: int, degree: int) -> None:
    """The sequence splits into `degree` equal contiguous chunks, or ValueError."""
    if degree < 1 or seq_len % degree:
        raise ValueError(f"sequence degree {degree} must divide the sequence length {seq_len}")


def check_mesh_sizes(mode: str, world_size: int, replicate: int, degree: int) -> None:
    """ValueError unless a sequence group of `degree` fits the sharding mode and world."""
    if mode not in ("fsdp", "hsdp"):
        raise ValueError(f"sequence parallelism needs sharding fsdp or hsdp, not {mode!r}")
    shard = world_size // replicate if mode == "hsdp" else world_size
    if mode == "hsdp" and world_size % replicate:
        raise ValueError(f"replicas {replicate} must divide the world size {world_size}")
    if degree < 1 or shard % degree:
        where = "ranks per replica" if mode == "hsdp" else "world size"
        raise ValueError(f"sequence degree {degree} must divide the {where} {shard}")
