"""How a run's ranks split the work: one torch-free value, made once.

Validation (trainer/validate.py) makes the Layout from the sharding mode, the world, the sequence
degree and the batch settings; `auto` (trainer/preflight/auto_run.py), once it has chosen a
degree and a micro-batch, makes a new one with `decided`. Everything that splits work takes it:
the device mesh (sharding/fsdp.py, sharding/sequence.py), each rank's share of the samples
(trainer/data/batches.py), the memory model's setup and the report. Nothing re-derives it.

    world_size   = replicate x shard            (fsdp: 1 replica; none: nothing sharded)
    ranks        = data groups x context x sequence   (adjacent ranks share each sample)
    global batch = micro_batch x grad_accum x data groups   (each sample counted once)

A sample is shared by sequence x context ranks (`share`): Ulysses' N (sharding.sequence,
sharding/sequence.py) innermost, so its all-to-all stays among neighbouring ranks (one node),
and the ring's M (sharding.context, sharding/ring.py) outside it. Rank r holds context chunk
(r // N) % M of each sample (its balanced pair of 2M chunks) and, within that, the contiguous
slice r % N.

`sequence` and `micro_batch` may be "auto" until `auto` decides them; `grad_accum` then counts
them as 1, and asking where a rank reads (`data_size`, `data_rank`, ...) is refused, so no part
can split the work by a degree that was never chosen.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional, Union

AUTO = "auto"
Count = Union[int, str]  # a positive integer, or "auto" until `auto` chooses one
MODES = ("none", "fsdp", "hsdp")


class LayoutError(ValueError):
    """A setting the world cannot be split by; `key` names the setting to change."""

    def __init__(self, key: str, message: str) -> None:
        super().__init__(f"{key}: {message}")
        self.key, self.message = key, message


def _is_count(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 1


def parse_count(value, key: str) -> Count:
    """A positive integer or "auto", as a setting such as sharding.sequence gives it."""
    if value == AUTO or _is_count(value):
        return value
    raise LayoutError(key, f"must be a positive integer or auto, got {value!r}")


@dataclass(frozen=True)
class Layout:
    world_size: int
    mode: str  # sharding.mode: none, fsdp or hsdp
    replicate: int  # HSDP replica groups (1 for fsdp / none)
    sequence: Count  # ranks sharing each sample (sharding.sequence)
    micro_batch: Count  # samples per micro-batch of a sequence group (train.micro_batch_size)
    grad_accum: int  # micro-batches per optimizer step (an `auto` part counted as 1)
    global_batch: Optional[int] = None  # train.global_batch_size as set (None: grad_accum's)
    context: int = 1  # ring ranks (sharding.context) x the sequence group share each sample

    @property
    def shard(self) -> int:
        """Ranks a parameter is sharded over."""
        return self.world_size // self.replicate if self.mode != "none" else 1

    @property
    def pending(self) -> tuple[str, ...]:
        """The settings `auto` has still to choose."""
        return tuple(key for key, value in (("sharding.sequence", self.sequence),
                                            ("train.micro_batch_size", self.micro_batch))
                     if value == AUTO)

    @property
    def degree(self) -> int:
        """The sequence degree; refused while it is `auto`."""
        if self.sequence == AUTO:
            raise LayoutError("sharding.sequence", "auto is chosen by `auto` before the run "
                              "is split (checkpointing=auto or train.micro_batch_size=auto "
                              "decides it); set a degree")
        return int(self.sequence)

    @property
    def least_degree(self) -> int:
        """The degree, or 1 while `auto` has not chosen (the checks that hold at every degree)."""
        return 1 if self.sequence == AUTO else int(self.sequence)

    @property
    def least_share(self) -> int:
        """Ranks sharing each sample, counting an undecided sequence degree as 1."""
        return self.least_degree * self.context

    @property
    def share(self) -> int:
        """Ranks sharing each sample: sequence x context (refused while sequence is auto)."""
        return self.degree * self.context

    @property
    def data_size(self) -> int:
        """How many shares of each global batch the ranks read: one per group sharing a
        sample (sequence x context ranks)."""
        return self.world_size // self.share

    def data_rank(self, rank: int) -> int:
        """Which share of each global batch `rank`'s sample group reads."""
        return rank // self.share

    def sequence_rank(self, rank: int) -> int:
        """`rank`'s place in its sequence (Ulysses) group: which contiguous slice of its
        context chunk of each sample it holds (of the sample itself when context is 1)."""
        return rank % self.degree

    def context_rank(self, rank: int) -> int:
        """`rank`'s place in its ring: which balanced pair of the sample's 2 x context chunks
        its sequence group holds."""
        return (rank // self.degree) % self.context

    @property
    def micro_batch_size(self) -> int:
        if self.micro_batch == AUTO:
            raise LayoutError("train.micro_batch_size", "auto is chosen by `auto` before the "
                              "run reads its data; set a micro-batch")
        return int(self.micro_batch)

    @property
    def global_batch_size(self) -> int:
        """Samples per optimizer step, each counted once (its sequence group shares it)."""
        return self.micro_batch_size * self.grad_accum * self.data_size

    def readers(self) -> str:
        """Who reads each global batch: the ranks, or their sequence groups."""
        if self.share == 1:
            return f"ranks {self.world_size}"
        ranks = (f"{self.degree} ranks" if self.context == 1 else
                 f"{self.share} ranks (sequence {self.degree} x context {self.context})")
        return (f"sequence groups {self.data_size} of {ranks}, each rank "
                f"1/{self.share} of every sample's tokens")

    def decided(self, sequence: int, micro_batch: int,
                context: Optional[int] = None) -> "Layout":
        """The layout once `auto` has chosen the degree (and the ring: `context`, None: as it
        is) and the micro-batch: made anew, as validation makes one, so the gradient
        accumulation follows them."""
        replicate = self.replicate if self.mode == "hsdp" else None
        return make_layout(self.mode, self.world_size, replicate, sequence, micro_batch,
                           1 if self.global_batch is not None else self.grad_accum,
                           self.global_batch,
                           context=self.context if context is None else context)

    def per_rank_samples(self) -> int:
        """The global batch's samples each sequence group reads per step, at the degree
        chosen (what `auto`'s micro-batches divide)."""
        if self.global_batch is None:
            raise LayoutError("train.global_batch_size", "train.micro_batch_size=auto needs "
                              "the global batch fixed, e.g. train.global_batch_size=64")
        return self.global_batch // self.data_size


def make_layout(mode: str, world_size: int, replicate: Optional[int], sequence, micro_batch,
                grad_accum: int, global_batch: Optional[int], num_nodes: int = 1,
                check_degree: Optional[Callable[[int], None]] = None, context=1,
                check_context: Optional[Callable[[int], None]] = None) -> Layout:
    """The layout of these settings on `world_size` ranks, or the LayoutError naming the
    setting that does not split it. replicate None: one replica per node (hsdp).
    check_degree / check_context: the model's own check of a sequence degree > 1 (its heads)
    or a context degree > 1 (its attention), run before the world's (so a degree no world
    could take is refused for the model's reason)."""
    if mode != "hsdp":
        if replicate is not None:
            raise LayoutError("sharding.replicate", f"only applies to sharding=hsdp (now "
                              f"sharding={mode})")
        replicate = 1
    else:
        replicate = num_nodes if replicate is None else replicate
        if not (isinstance(replicate, int) and replicate > 0):
            raise LayoutError("sharding.replicate", f"must be a positive integer, got "
                              f"{replicate}")
        if world_size % replicate:
            raise LayoutError("sharding.replicate", f"{replicate} does not divide the world "
                              f"size {world_size}")
    sequence = parse_count(sequence, "sharding.sequence")
    if sequence not in (1, AUTO):
        if mode == "none":
            raise LayoutError("sharding.sequence", f"{sequence} needs sharding=fsdp or hsdp "
                              "(the sequence ranks shard the parameters with FSDP), now "
                              "sharding=none")
        if check_degree is not None:
            check_degree(sequence)
        try:
            check_mesh_sizes(mode, world_size, replicate, sequence)
        except ValueError as exc:
            raise LayoutError("sharding.sequence", str(exc)) from None
    _check_context(mode, world_size, replicate, sequence, context, check_context)
    grad_accum = _grad_accum(world_size, sequence, micro_batch, grad_accum, global_batch,
                             context)
    return Layout(world_size, mode, replicate, sequence, micro_batch, grad_accum, global_batch,
                  context)


def _check_context(mode: str, world_size: int, replicate: int, sequence: Count, context,
                   check_context: Optional[Callable[[int], None]]) -> None:
    """sharding.context: a whole number of rings of `context` sequence groups per replica."""
    if not _is_count(context):
        raise LayoutError("sharding.context", f"must be a positive integer, got {context!r}")
    if context == 1:
        return
    if mode == "none":
        raise LayoutError("sharding.context", f"{context} needs sharding=fsdp or hsdp (the "
                          "ring's ranks shard the parameters with FSDP), now sharding=none")
    if check_context is not None:
        check_context(context)
    share = context * (1 if sequence == AUTO else sequence)
    try:
        check_mesh_sizes(mode, world_size, replicate, share)
    except ValueError:
        where = "ranks per replica" if mode == "hsdp" else "world size"
        shard = world_size // replicate if mode == "hsdp" else world_size
        raise LayoutError("sharding.context", f"sharding.sequence x sharding.context = "
                          f"{share} must divide the {where} {shard}") from None


def _grad_accum(world_size: int, sequence: Count, micro_batch: Count, grad_accum: int,
                global_batch: Optional[int], context: int = 1) -> int:
    """train.grad_accum, or what makes train.global_batch_size: an `auto` part counts as 1
    (until `auto` chooses it, and makes the layout again)."""
    if global_batch is None:
        return grad_accum
    if not global_batch > 0:
        raise LayoutError("train.global_batch_size", f"must be a positive integer, got "
                          f"{global_batch}")
    if grad_accum != 1:
        raise LayoutError("train.grad_accum", "set either train.grad_accum or "
                          "train.global_batch_size, not both")
    degree = (1 if sequence == AUTO else sequence) * context
    micro = 1 if micro_batch == AUTO else micro_batch
    data_size = max(1, world_size // degree)
    per_accum = micro * data_size
    if global_batch % per_accum:
        what = ("world size" if degree == 1 else f"(world size / sharding.sequence={degree})"
                if context == 1 else f"(world size / sequence x context={degree})")
        raise LayoutError("train.global_batch_size", f"{global_batch} is not divisible by "
                          f"train.micro_batch_size x {what} = {micro_batch} x {data_size}")
    return global_batch // per_accum


def check_mesh_sizes(mode: str, world_size: int, replicate: int, degree: int) -> None:
    """ValueError unless a sequence group of `degree` fits the sharding mode and world."""
    if mode not in ("fsdp", "hsdp"):
        raise ValueError(f"sequence parallelism needs sharding fsdp or hsdp, not {mode!r}")
    shard = world_size // replicate if mode == "hsdp" else world_size
    if mode == "hsdp" and world_size % replicate:
        raise ValueError(f"replicas {replicate} must divide the world size {world_size}")
    if degree < 1 or shard % degree:
        where = "ranks per replica" if mode == "hsdp" else "world size"
        raise ValueError(f"sequence degree {degree} must divide the {where} {shard}")


def auto_degrees(layout: Layout, seq_len: int) -> list[int]:
    """The degrees `auto` tries, smallest first: the divisors of the world that divide the
    sequence too (the mesh sizes and the heads are checked for each when it is tried); with
    a ring of M, N x M divides the world and 2 x N x M the sequence (the balanced chunks)."""
    if layout.sequence != AUTO:
        return [layout.degree]
    world, m = layout.world_size, layout.context
    chunks = 2 * m if m > 1 else 1
    return [d for d in range(1, world + 1)
            if world % (d * m) == 0 and seq_len % (d * chunks) == 0]


def mesh_layout(mode: str, world_size: int, replicate: Optional[int] = None,
                sequence: int = 1, context: int = 1) -> Layout:
    """The layout of a mesh alone (one sample per micro-batch, no accumulation): for tools
    and tests that shard a model without a run's batch settings."""
    return make_layout(mode, world_size, replicate, sequence, 1, 1, None, context=context)
