"""Validation: every `train.eval_every` steps and at the last step, and at step 0 of a fresh
run with `train.eval_at_start`."""

from __future__ import annotations

from typing import Optional, Sequence

import torch
from torch import nn

from sharding.fsdp import reshard_all
from trainer.config import TrainConfig
from trainer.distenv import mean_over_ranks
from trainer.observe.metrics import RunLogger
from trainer.task import Task

Batch = tuple[torch.Tensor, ...]


@torch.no_grad()
def evaluate(model: nn.Module, batches: Sequence[Batch], task: Task, device: torch.device,
             weights: Optional[Sequence[float]] = None) -> dict[str, float]:
    """The task's validation figures (val_loss; a classifier's val_accuracy too) over every
    rank's batches: the mean over the validation samples, however the ranks split them.
    `weights`: each batch's real samples over a full micro-batch's (0: a stand-in, run so
    every rank runs as many forwards; trainer/data/validation.py); None: every batch full.
    The batches wait in host memory (high-resolution images are large) and visit the device
    one at a time."""
    model.eval()
    loss = torch.zeros((), device=device)
    correct = torch.zeros_like(loss)  # a summed loss (packed documents): the targets counted
    counted = torch.zeros_like(loss)  # full batches' worth
    for n, batch in enumerate(batches):
        batch_loss, batch_correct = task.eval_batch(model, *(t.to(device) for t in batch))
        share = 1.0 if weights is None else weights[n]
        # A summed loss is its targets' sum already (a short batch has fewer); a mean is
        # weighed by the samples it is the mean of. A full batch weighs exactly 1.
        weight = float(share > 0) if task.summed else share
        loss += batch_loss * weight
        correct += batch_correct * weight
        counted += weight
    reshard_all(model)
    model.train()
    return task.eval_metrics(loss, correct, counted, mean_over_ranks)


class Evaluation:
    """Evaluates when due and records the result (every rank evaluates: the loss is a
    collective; only rank 0's logger writes). Built from the train section: `eval_every`,
    the last step, and `eval_at_start` (step 0 of a fresh run, not of a resumed one)."""

    def __init__(self, t: TrainConfig, fresh: bool, model: nn.Module, batches: Sequence[Batch],
                 task: Task, device: torch.device, logger: RunLogger,
                 weights: Optional[Sequence[float]] = None) -> None:
        self.model, self.batches, self.task, self.device = model, batches, task, device
        self.weights = weights  # each batch's share of a full one (trainer/data/validation.py)
        self.every, self.steps, self.logger = t.eval_every, t.steps, logger
        self.at_start = fresh and t.eval_at_start

    def should_evaluate(self, step: int) -> bool:
        return step % self.every == 0 or step == self.steps

    def run(self, step: int, wandb_step: Optional[int] = None) -> None:
        """Evaluate now, recording it at `step`."""
        self.logger.record({"step": step, **evaluate(self.model, self.batches, self.task,
                                                     self.device, self.weights)}, wandb_step=wandb_step)

    def start(self) -> None:
        """Before the first step: the step-0 evaluation, if asked for."""
        if self.at_start:
            self.run(0)

    def maybe(self, step: int, wandb_step: int) -> None:
        if self.should_evaluate(step):
            self.run(step, wandb_step)
