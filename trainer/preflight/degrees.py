"""The sequence degree and tile count of a config as numbers, without torch (the report's tables
import this before any check has passed)."""

from __future__ import annotations


def sequence_degree(cfg) -> int:
    """sharding.sequence as a number (`auto` before auto has chosen: 1)."""
    value = cfg.sharding.sequence
    return 1 if value in (None, "auto") else int(value)


def tile_count(cfg) -> int:
    """checkpointing.tiles as a number (`auto` before auto has chosen: 1)."""
    value = cfg.checkpointing.tiles
    return 1 if value in (None, "auto") else int(value)
