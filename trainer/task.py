"""The run's task: what the model is trained to do, as its family makes it for the run's data and
loss head (trainer/models/families/base.py's Task: its loss, an example micro-batch, its tokens
per sample). `task_for` is the one way to make it, so the loop, the planner's meta trace, auto-fit
and the pre-flight report all train and measure the same task. Importing this module does not
import torch (the pre-flight checks and the report stay fast to refuse a bad command line).
"""

from __future__ import annotations

import dataclasses
from typing import Optional

from trainer.config import CheckpointingConfig, Config, DataConfig, ModelConfig
from trainer.data.factory import source_of
from trainer.models.families import Task, family_of
from trainer.models.families.base import IGNORE_INDEX

__all__ = ["IGNORE_INDEX", "Task", "task_for", "with_head_share"]


def task_for(model: ModelConfig, data: DataConfig, head: CheckpointingConfig) -> Task:
    """The task of a run of this model on this data with this loss head (checkpointing.head,
    head_chunk_tokens, head_budget_mib): packed documents sum their loss over the supervised
    targets; a language model's chunked head makes that loss itself, chunk by chunk."""
    return family_of(model).task(model, data.seq_len, source_of(data).sums_loss, head)


def with_head_share(cfg: Config) -> tuple[Config, Optional[str]]:
    """The config with checkpointing.head_supervised_fraction filled in where it is null and
    the head runs on supervised rows (checkpointing.head_rows=supervised, data=text/chat): the
    busiest window's share of learned targets in the prepared cache, if there is one. Also a
    line saying which share the memory model, the report and auto plan the head's rows for,
    and where it came from (None where the head runs on every row anyway)."""
    c = cfg.checkpointing
    source = source_of(cfg.data)
    if not (source.sums_loss and c.head_rows == "supervised"):
        return cfg, None
    if c.head_supervised_fraction is not None:
        return cfg, (f"rows planned at {c.head_supervised_fraction:.1%} supervised "
                     "(checkpointing.head_supervised_fraction)")
    from trainer.validate import model_facts

    found = source.prepared_supervised_share(cfg.data, model_facts(cfg.model))
    if found is None:
        return cfg, ("rows planned at 100% supervised (every row: no prepared data cache yet; "
                     "checkpointing.head_supervised_fraction=F plans for fewer)")
    share, folder = found
    cfg = dataclasses.replace(cfg, checkpointing=dataclasses.replace(
        c, head_supervised_fraction=share))
    return cfg, (f"rows planned at {share:.1%} supervised (the busiest window of the "
                 f"prepared cache {folder})")
