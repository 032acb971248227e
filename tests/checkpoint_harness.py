"""Shared by the checkpointing and offload tests: the policies and a seeded batch maker."""

from __future__ import annotations

import torch

POLICIES = [["checkpointing=none"], ["checkpointing=full"], ["checkpointing=every_k"],
            ["checkpointing=sqrt"], ["checkpointing=selective"],
            # A budget between all-full and all-keep makes the planner mix options.
            ["checkpointing=budget", "checkpointing.budget=0.45"]]
SMALL = ["data.seq_len=64", "train.micro_batch_size=4", "model.dropout=0.1",
         "checkpointing.profile_repeats=1"]


def batch(step: int, rank: int = 0, size: int = 4, seq: int = 64) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 * step + rank)
    return torch.randint(0, 256, (size, seq + 1), generator=g)
