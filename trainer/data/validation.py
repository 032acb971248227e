"""The validation set: a fixed number of samples, the same whatever the world size, the
sequence degree or the micro-batch, so val_loss goes on across a resume that changes them.

Its samples are the global validation samples 0 .. S-1 in order (window = sample % N, no
shuffling). A fresh run takes S = train.eval_batches x micro-batch x data-parallel groups (each
group scores eval_batches full micro-batches, as it always did); a checkpoint records S, and a
resume keeps it (trainer/state/resume.py), whatever groups and micro-batch it runs with.

Each data-parallel group scores a contiguous block of the S, in micro-batches (its last one may
be short). Every rank must run as many forwards (a sharded model gathers its parameters in each,
a collective), so a rank with fewer real batches runs stand-ins: one sample each, counted 0
(`rows` says how many real samples each batch holds). trainer/observe/evaluate.py weighs each
batch by its samples, so val_loss is the mean over the S samples however they were split.
"""

from __future__ import annotations

import numpy as np

from trainer.data.tokens import Batch, Windows, check_rank, stack_windows


def default_samples(eval_batches: int, micro_batch_size: int, groups: int) -> int:
    """A fresh run's S: eval_batches micro-batches for each data-parallel group."""
    return eval_batches * micro_batch_size * groups


def val_share(dataset: Windows, samples: int, micro_batch_size: int, dp_rank: int,
              dp_size: int) -> tuple[list[Batch], list[int]]:
    """This group's batches of the `samples` validation samples, and the real samples in each
    (0: a stand-in); as many batches on every group."""
    if samples < 1 or micro_batch_size < 1:
        raise ValueError(f"samples and micro_batch_size must be >= 1, "
                         f"got {samples} and {micro_batch_size}")
    check_rank(dp_rank, dp_size)
    each, extra = divmod(samples, dp_size)
    first = dp_rank * each + min(dp_rank, extra)
    mine = np.arange(first, first + each + (dp_rank < extra), dtype=np.int64)
    forwards = max(1, -(-(each + (extra > 0)) // micro_batch_size))
    window_ids = mine % dataset.num_windows
    batches = [stack_windows(dataset, window_ids[b:b + micro_batch_size])
               for b in range(0, len(mine), micro_batch_size)]
    rows = [len(window_ids[b:b + micro_batch_size]) for b in range(0, len(mine), micro_batch_size)]
    stand_in = stack_windows(dataset, np.zeros(1, dtype=np.int64))
    return batches + [stand_in] * (forwards - len(batches)), rows + [0] * (forwards - len(rows))


def val_batches(dataset: Windows, num_batches: int, micro_batch_size: int,
                dp_rank: int, dp_size: int) -> list[Batch]:
    """This rank's share of a fresh run's validation set: `num_batches` full micro-batches."""
    if num_batches < 1:
        raise ValueError(f"num_batches must be >= 1, got {num_batches}")
    return val_share(dataset, default_samples(num_batches, micro_batch_size, dp_size),
                     micro_batch_size, dp_rank, dp_size)[0]
