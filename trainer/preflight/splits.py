"""How `auto` splits a sample over the ranks that share it (sharding.sequence=auto): Ulysses
(sharding.sequence=N) and the ring (sharding.context=M), for each count of ranks per sample.

For each share S (a divisor of the world, smallest first: the fewest exchanges), the split is
the largest Ulysses degree N that stays inside a node (its all-to-all sends every token's q/k/v:
over the network it is the slow part) and that the model's heads take (the family's
check_sequence), the ring taking the rest (M = S / N) where the family runs the ring (its
check_context); N x 2M must divide data.seq_len (the ring's balanced chunks). A share no split
serves is left out. With sharding.context set above 1 the ring is the user's: only N is chosen.
"""

from __future__ import annotations

from typing import Callable

from sharding.layout import AUTO, Layout, auto_degrees
from trainer.config import Config, ConfigError
from trainer.models.families import family_of


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def _accepts(check: Callable, cfg: Config, degree: int) -> bool:
    try:
        check(cfg.model, degree)
    except ConfigError:
        return False
    return True


def sample_splits(cfg: Config, layout: Layout, gpus_per_node: int) -> list[tuple[int, int]]:
    """(sequence, context) pairs `auto` tries, the fewest ranks per sample first."""
    seq_len = cfg.data.seq_len
    if layout.sequence != AUTO or layout.context > 1:
        return [(d, layout.context) for d in auto_degrees(layout, seq_len)]
    family = family_of(cfg.model)
    ring = _accepts(family.check_context, cfg, 2)
    splits = []
    for share in _divisors(layout.world_size):
        for n in reversed(_divisors(share)):
            m = share // n
            if n > 1 and (n > gpus_per_node or not _accepts(family.check_sequence, cfg, n)):
                continue
            if m > 1 and not ring or seq_len % (n * (2 * m if m > 1 else 1)):
                continue
            splits.append((n, m))
            break
    return splits
