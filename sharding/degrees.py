"""The sizes sequence parallelism needs, as pure checks: a config validator runs them before any
process group starts, and without torch (the families import this module). Whether a group
of N fits the world is the layout's to say (sharding/layout.py).

  kv_repeats        how often each key/value head is repeated so N ranks can split the heads
  check_degree      N divides the sequence
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
