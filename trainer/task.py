"""The run's task: what the model is trained to do, as its family makes it for the run's data and
loss head (trainer/models/families/base.py's Task: its loss, an example micro-batch, its tokens
per sample). `task_for` is the one way to make it, so the loop, the planner's meta trace, auto-fit
and the pre-flight report all train and measure the same task. Importing this module does not
import torch (the pre-flight checks and the report stay fast to refuse a bad command line).
"""

from __future__ import annotations

from trainer.config import CheckpointingConfig, DataConfig, ModelConfig
from trainer.models.families import Task, family_of
from trainer.models.families.base import IGNORE_INDEX
from trainer.validate import DOCUMENT_SOURCES, IMAGE_SOURCES

__all__ = ["IGNORE_INDEX", "Task", "build_task_datasets", "task_for"]


def task_for(model: ModelConfig, data: DataConfig, head: CheckpointingConfig) -> Task:
    """The task of a run of this model on this data with this loss head (checkpointing.head,
    head_chunk_tokens, head_budget_mib): packed documents sum their loss over the supervised
    targets; a language model's chunked head makes that loss itself, chunk by chunk."""
    return family_of(model).task(model, data.seq_len, data.source in DOCUMENT_SOURCES, head)


def build_task_datasets(model: ModelConfig, data: DataConfig, vocab_size: int, seed: int,
                        preparer: bool = True, share: tuple[int, int, int, int] = (0, 1, 1, 1)):
    """(train, val) datasets for the task: token windows, packed documents, or labelled images.
    preparer: this process tokenizes documents not cached yet (one per node); others wait.
    share: (rank, world, micro-batch, accumulation), what a streamed corpus needs."""
    if data.source in DOCUMENT_SOURCES:
        from trainer.data.documents import text_datasets
        from trainer.data.sources import document_settings

        return text_datasets(data.path, data.val_path, data.tokenizer or model.path,
                             document_settings(data), data.cache_dir, vocab_size, preparer,
                             share if data.streaming else None)
    if data.source in IMAGE_SOURCES:
        from trainer.data.images import image_datasets

        return image_datasets(data.source, model.image_size, model.channels, model.num_classes,
                              seed, data.train_path, data.val_path, data.augment,
                              data.skip_bad_images, family_of(model).image_preprocessing(model))
    from trainer.data.tokens import build_datasets

    train, val, _ = build_datasets(data.source, data.seq_len, vocab_size, seed, data.train_path,
                                   data.val_path, data.token_dtype, data.max_corpus_bytes)
    return train, val
