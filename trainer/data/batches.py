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

from sharding.layout import Layout
from sharding.ring import sample_slice
from trainer.config import ConfigError
from trainer.data.prefetch import Prefetcher
from trainer.data.tokens import step_counts, train_batch
from trainer.data.validation import default_samples, val_share
from trainer.faults import TimeoutWatchdog

Batch = tuple[torch.Tensor, ...]  # (inputs, targets), or packed: (inputs, targets, positions)
Counts = Optional[tuple[int, int]]  # (supervised targets, real tokens) of a whole step


@dataclass(frozen=True)
class Sampling:
    """How this rank takes its share of every global batch: where the layout places it."""
    rank: int
    layout: Layout  # the run's, with its micro-batch and degree decided
    seed: int  # of the one global order of samples
    eval_batches: int  # validation micro-batches per rank
    preparer: bool = True  # this process prepares what is not cached yet (one per node)
    local_size: int = 1  # ranks on this node (data.num_proc's default splits its cores)

    @property
    def world_size(self) -> int:
        return self.layout.world_size

    @property
    def micro_batch_size(self) -> int:
        return self.layout.micro_batch_size

    @property
    def grad_accum(self) -> int:
        return self.layout.grad_accum

    @property
    def sequence(self) -> int:
        """Ranks sharing each sample (sharding.sequence x sharding.context): these adjacent
        ranks read the same samples, each its share of every sample's tokens."""
        return self.layout.share

    @property
    def data_rank(self) -> int:
        """Which share of each global batch this rank's sequence group reads."""
        return self.layout.data_rank(self.rank)

    @property
    def data_size(self) -> int:
        return self.layout.data_size

    @property
    def global_batch_size(self) -> int:
        """Samples per step, each counted once (its sequence group shares it)."""
        return self.layout.global_batch_size

    def sliced(self, batches: list[Batch]) -> list[Batch]:
        """This rank's share of each micro-batch (inputs, targets, and packed positions): its
        ring place's balanced pair of chunks (sharding.context), within that its contiguous
        sequence slice (sharding.sequence; sharding/ring.py's sample_slice), in host memory:
        only the share travels to the device. The model takes the share's global positions."""
        if self.sequence == 1:
            return batches
        layout = self.layout
        place = (layout.context_rank(self.rank), layout.context,
                 layout.sequence_rank(self.rank), layout.degree)
        return [tuple(sample_slice(t, *place).contiguous() for t in batch)
                for batch in batches]


class Data:
    """What the Trainer reads: `batch(index)` is this rank's micro-batches of the global batch
    `index` and that step's (supervised, real) token counts over every rank (None where the
    data does not count them); `val` is this rank's validation batches, `val_weights` each
    one's real samples over a full micro-batch's (0: a stand-in), of `val_samples` over every
    rank (trainer/data/validation.py)."""

    sampling: Sampling
    val: list
    val_weights: list[float]
    val_samples: int

    def _validate_on(self, dataset, samples: Optional[int] = None) -> None:
        s = self.sampling
        self._val_set = dataset
        self.val_samples = samples or default_samples(s.eval_batches, s.micro_batch_size,
                                                      s.data_size)
        batches, rows = val_share(dataset, self.val_samples, s.micro_batch_size, s.data_rank,
                                  s.data_size)
        self.val, self.val_weights = s.sliced(batches), [r / s.micro_batch_size for r in rows]

    def keep_validation(self, samples: int) -> None:
        """Score these many validation samples from here on (a checkpoint's: the set it was
        scored on before, whatever the world size, degree and micro-batch now)."""
        self._validate_on(self._val_set, samples)

    def batch(self, index: int) -> tuple[list[Batch], Counts]:
        raise NotImplementedError

    def check_resume(self, saved_world_size: int, saved_global_batch: int,
                     saved_sequence: int = 1) -> None:
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
        self._validate_on(val)
        # The global batch index at which the window order starts: 0, or where a resume on
        # changed data went on with a new order (data.on_change=new_epoch).
        self.origin = 0
        self._ahead = Prefetcher(self._read, workers)

    def batch(self, index: int) -> tuple[list[Batch], Counts]:
        return self._ahead.get(index)

    def _read(self, index: int) -> tuple[list[Batch], Counts]:
        s = self.sampling
        at = index - self.origin if index >= self.origin else index
        return (s.sliced(train_batch(self.train, at, s.micro_batch_size, s.grad_accum,
                                     s.data_rank, s.data_size, s.seed)),
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
        self._validate_on(val)
        self._ahead = Prefetcher(stream.read, workers)

    def batch(self, index: int) -> tuple[list[Batch], Counts]:
        batches, counts = self._ahead.get(index)
        batches = self.sampling.sliced(batches)
        if not dist.is_initialized():
            return batches, counts
        total = torch.tensor(counts, dtype=torch.int64, device=self.device)
        with self.watchdog(f"batch {index} (summing the stream's token counts over the ranks)"):
            dist.all_reduce(total)
        # Each rank of a sequence group counted its group's whole windows: once per group.
        return batches, (int(total[0]) // self.sampling.sequence,
                         int(total[1]) // self.sampling.sequence)

    def check_resume(self, saved_world_size: int, saved_global_batch: int,
                     saved_sequence: int = 1) -> None:
        """Records are split between the sequence groups: another number of them or another
        global batch would hand each other records, so the run could not continue where it
        stood (the degree itself may change with the world: 2 ranks at N=2 read as 1 at N=1)."""
        s = self.sampling
        saved_shares = saved_world_size // saved_sequence
        if (saved_shares, saved_global_batch) != (s.data_size, s.global_batch_size):
            raise ConfigError(
                "data.streaming", f"this run streams its data and was saved by "
                f"{_groups_text(saved_world_size, saved_sequence)} with a global batch of "
                f"{saved_global_batch}; a stream resumes only on the same (now "
                f"{_groups_text(s.world_size, s.sequence)}, {s.global_batch_size}): start it on "
                f"{saved_world_size} ranks, or prepare the data once "
                "(data.streaming=false) to resume anywhere")

    def close(self) -> None:
        self._ahead.close()


def _groups_text(world_size: int, sequence: int) -> str:
    if sequence == 1:
        return f"{world_size} ranks"
    return f"{world_size} ranks in groups of sharding.sequence={sequence}"
