"""The Data a Trainer holds: this rank's micro-batches of every step, read ahead in background
threads (trainer/data/prefetch.py), with the step's token counts over every rank, and the
validation batches.

Two ways to read: a dataset indexable by window (token windows, prepared documents, images)
is read in the one seeded global order (trainer/data/tokens.py), so every rank computes the
whole step's counts itself; a stream is read in order by each rank, whose counts are summed
over the ranks here, in the training thread (a collective must not run in a read-ahead thread:
ranks would issue them in different orders).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
import torch.distributed as dist

from trainer.config import ConfigError
from trainer.data.prefetch import Prefetcher
from trainer.data.tokens import step_counts, train_batch, val_batches
from trainer.faults import TimeoutWatchdog

Batch = tuple[torch.Tensor, ...]  # (inputs, targets), or packed: (inputs, targets, positions)
Counts = Optional[tuple[int, int]]  # (supervised targets, real tokens) of a whole step


@dataclass(frozen=True)
class Sampling:
    """How this rank takes its share of every global batch."""
    rank: int
    world_size: int
    micro_batch_size: int
    grad_accum: int
    seed: int  # of the one global order of samples
    eval_batches: int  # validation micro-batches per rank
    preparer: bool = True  # this process prepares what is not cached yet (one per node)

    @property
    def global_batch_size(self) -> int:
        return self.micro_batch_size * self.grad_accum * self.world_size


class Data:
    """What the Trainer reads: `batch(index)` is this rank's micro-batches of the global batch
    `index` and that step's (supervised, real) token counts over every rank (None where the
    data does not count them); `val` is this rank's validation batches."""

    val: list

    def batch(self, index: int) -> tuple[list[Batch], Counts]:
        raise NotImplementedError

    def check_resume(self, saved_world_size: int, saved_global_batch: int) -> None:
        """Refuse a checkpoint this data cannot continue from (ConfigError)."""

    def record(self) -> Optional[dict]:
        """What a checkpoint records of the data (trainer/data/identity.py), if anything."""
        return None

    def continue_from(self, saved: Optional[dict], on_change: str, batch_index: int,
                      step: int) -> Optional[str]:
        """Check a checkpoint's record of its data against this data: ConfigError for a
        change refused, else a note of the change gone on with (data.on_change)."""
        return None

    def close(self) -> None:
        """Stop reading ahead."""


class SampledData(Data):
    """An indexable dataset read in the global order: step s's global batch is the same
    whatever the world size, so a resume may change it."""

    def __init__(self, train, val, sampling: Sampling, workers: int) -> None:
        self.train, self.sampling = train, sampling
        self.val = val_batches(val, sampling.eval_batches, sampling.micro_batch_size,
                               sampling.rank, sampling.world_size)
        # The global batch index at which the window order starts: 0, or where a resume on
        # changed data went on with a new order (data.on_change=new_epoch).
        self.origin = 0
        self._ahead = Prefetcher(self._read, workers)

    def batch(self, index: int) -> tuple[list[Batch], Counts]:
        return self._ahead.get(index)

    def _read(self, index: int) -> tuple[list[Batch], Counts]:
        s = self.sampling
        at = index - self.origin if index >= self.origin else index
        return (train_batch(self.train, at, s.micro_batch_size, s.grad_accum, s.rank,
                            s.world_size, s.seed),
                step_counts(self.train, at, s.global_batch_size, s.seed))

    def record(self) -> Optional[dict]:
        identity = getattr(self.train, "identity", None)
        return None if identity is None else {"identity": identity, "origin": self.origin}

    def continue_from(self, saved: Optional[dict], on_change: str, batch_index: int,
                      step: int) -> Optional[str]:
        from trainer.data.identity import continue_order

        self.origin, note = continue_order(saved, getattr(self.train, "identity", None),
                                           on_change, batch_index, step)
        return note

    def close(self) -> None:
        self._ahead.close()


class StreamedData(Data):
    """A stream (trainer/data/stream.py): each rank packs its own windows in stream order."""

    def __init__(self, stream, val, sampling: Sampling, workers: int, device: torch.device,
                 watchdog: TimeoutWatchdog) -> None:
        self.stream, self.sampling, self.device, self.watchdog = stream, sampling, device, watchdog
        self.val = val_batches(val, sampling.eval_batches, sampling.micro_batch_size,
                               sampling.rank, sampling.world_size)
        self._ahead = Prefetcher(stream.read, workers)

    def batch(self, index: int) -> tuple[list[Batch], Counts]:
        batches, counts = self._ahead.get(index)
        if not dist.is_initialized():
            return batches, counts
        total = torch.tensor(counts, dtype=torch.int64, device=self.device)
        with self.watchdog(f"batch {index} (summing the stream's token counts over the ranks)"):
            dist.all_reduce(total)
        return batches, (int(total[0]), int(total[1]))

    def check_resume(self, saved_world_size: int, saved_global_batch: int) -> None:
        """Records are split between the ranks: another world size or global batch would hand
        each rank other records, so the run could not continue where it stood."""
        s = self.sampling
        if (saved_world_size, saved_global_batch) != (s.world_size, s.global_batch_size):
            raise ConfigError(
                "data.streaming", f"this run streams its data and was saved by "
                f"{saved_world_size} ranks with a global batch of {saved_global_batch}; a stream "
                f"resumes only on the same (now {s.world_size} ranks, {s.global_batch_size}): "
                f"start it on {saved_world_size} ranks, or prepare the data once "
                "(data.streaming=false) to resume anywhere")

    def close(self) -> None:
        self._ahead.close()
