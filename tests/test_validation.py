"""The validation set is a fixed set of samples whatever the data-parallel groups and the
micro-batch (issue 47, fault 8: a resume from 2 ranks onto 1 scored half the samples, val_loss
5.5e-3 off): trainer/data/validation.py splits it, trainer/observe/evaluate.py weighs it, and a
resume keeps the checkpoint's (trainer/state/resume.py). The end-to-end case, 2 ranks saved and
1 resumed against an uninterrupted run, is tests/test_resume.py's
test_saved_on_two_ranks_resumed_on_one."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
import torch
from torch import nn

from trainer.data.tokens import WindowDataset
from trainer.data.validation import default_samples, val_share
from trainer.observe.evaluate import evaluate

SEQ = 4


def _windows(n: int) -> WindowDataset:
    return WindowDataset(np.arange(n * SEQ + 1, dtype=np.int64), SEQ)


def _ids(batch) -> list[int]:
    return [int(row[0]) // SEQ for row in batch[0]]


@pytest.mark.parametrize("samples, micro, groups", [(16, 4, 2), (16, 4, 1), (16, 3, 1),
                                                    (7, 2, 3), (5, 4, 2), (2, 1, 4), (9, 9, 2)])
def test_every_split_scores_the_same_samples_once(samples, micro, groups) -> None:
    dataset = _windows(11)  # fewer windows than samples: they wrap, as before
    seen, forwards = [], set()
    for rank in range(groups):
        batches, rows = val_share(dataset, samples, micro, rank, groups)
        forwards.add(len(batches))
        assert len(rows) == len(batches) and all(0 <= r <= micro for r in rows)
        for batch, real in zip(batches, rows):
            assert len(batch[0]) == max(real, 1)  # a stand-in is one sample, counted 0
            seen += _ids(batch)[:real]
    assert len(forwards) == 1  # every rank runs as many forwards (a sharded model needs it)
    assert seen == [s % 11 for s in range(samples)]


def test_a_fresh_run_scores_eval_batches_full_micro_batches_a_group() -> None:
    dataset = _windows(100)
    for rank in range(3):
        batches, rows = val_share(dataset, default_samples(2, 5, 3), 5, rank, 3)
        assert rows == [5, 5] and [_ids(b) for b in batches] == [
            list(range(10 * rank, 10 * rank + 5)), list(range(10 * rank + 5, 10 * rank + 10))]


class _PerSample(nn.Module):
    """Logits that make each window's loss different (so a wrong weighting shows)."""

    def __init__(self) -> None:
        super().__init__()
        self.table = nn.Embedding(64, 8)
        torch.nn.init.normal_(self.table.weight, generator=torch.Generator().manual_seed(0))

    def forward(self, inputs, positions=None):
        return self.table(inputs % 64)


def _task(summed: bool):
    from trainer.models.families.base import IGNORE_INDEX, Task

    def criterion(logits, targets):
        return nn.functional.cross_entropy(logits.flatten(0, 1), (targets % 8).flatten(),
                                           ignore_index=IGNORE_INDEX,
                                           reduction="sum" if summed else "mean")

    return Task("lm", (SEQ,), SEQ, criterion, summed=summed)


@pytest.mark.parametrize("summed", [False, True], ids=["mean loss", "summed loss"])
def test_val_loss_is_the_mean_over_the_samples_however_they_are_batched(summed) -> None:
    """7 samples in micro-batches of 7, 3 (3+3+1) and 2 with a stand-in after them: one val_loss.
    Each window's loss differs, so weighing a short batch as a full one would show."""
    dataset, model, task = _windows(7), _PerSample(), _task(summed)
    got = []
    for micro in (7, 3, 2):
        batches, rows = val_share(dataset, 7, micro, 0, 1)
        if micro == 2:  # what a rank with fewer real batches than its peers runs
            batches, rows = batches + [batches[0]], rows + [0]
        weights = [r / micro for r in rows]
        got.append(evaluate(model, batches, task, torch.device("cpu"), weights)["val_loss"])
    assert got[1] == pytest.approx(got[0], rel=1e-6) and got[2] == pytest.approx(got[0], rel=1e-6)
    halves = [evaluate(model, val_share(dataset, 7, 4, 0, 1)[0][:1], task,
                       torch.device("cpu"))["val_loss"]]
    assert abs(halves[0] - got[0]) > 1e-3  # the first 4 alone are another figure


def _state(eval_batches: int, world: int, recorded=None) -> dict:
    return {"config": {"train": {"eval_batches": eval_batches, "micro_batch_size": 4}},
            "world_size": world, "sequence": 1, "val_samples": recorded}


class _Data:
    def __init__(self, samples: int) -> None:
        self.val_samples, self.kept = samples, None

    def keep_validation(self, samples: int) -> None:
        self.kept = self.val_samples = samples


def _config(eval_batches: int):
    return SimpleNamespace(train=SimpleNamespace(eval_batches=eval_batches))


@pytest.mark.parametrize("recorded", [16, None], ids=["recorded", "from the saved config"])
def test_a_resume_keeps_the_checkpoints_set_and_declares_a_new_one(recorded) -> None:
    from trainer.state.resume import _same_validation

    data = _Data(8)  # 1 rank now: 2 batches of 4 by default; 2 ranks scored 16 before
    assert _same_validation(_state(2, 2, recorded), _config(2), data) is None
    assert data.kept == 16
    data = _Data(12)  # train.eval_batches 2 -> 3: a new set, asked for
    line = _same_validation(_state(2, 2, recorded), _config(3), data)
    assert data.kept is None and line == (
        "validation is 12 samples now, 16 before (train.eval_batches changed): val_loss from "
        "here is not comparable with the values before")
