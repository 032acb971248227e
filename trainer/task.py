"""The run's task: what the model is trained to do, as its family makes it for the run's data and
loss head (trainer/models/families/base.py's Task: its loss, an example micro-batch, its tokens
per sample). `task_for` is the one way to make it, so the loop, the planner's meta trace, auto-fit
and the pre-flight report all train and measure the same task. Importing this module does not
import torch (the pre-flight checks and the report stay fast to refuse a bad command line).
"""

from __future__ import annotations

from trainer.config import CheckpointingConfig, DataConfig, ModelConfig
from trainer.data.factory import source_of
from trainer.models.families import Task, family_of
from trainer.models.families.base import IGNORE_INDEX

__all__ = ["IGNORE_INDEX", "Task", "task_for"]


def task_for(model: ModelConfig, data: DataConfig, head: CheckpointingConfig) -> Task:
    """The task of a run of this model on this data with this loss head (checkpointing.head,
    head_chunk_tokens, head_budget_mib): packed documents sum their loss over the supervised
    targets; a language model's chunked head makes that loss itself, chunk by chunk."""
    return family_of(model).task(model, data.seq_len, source_of(data).sums_loss, head)
