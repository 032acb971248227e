"""Memory per rank over one training step, as segments in time order, from a memory estimate.

The numbers are the estimate's (checkpointing/planner/memory.py), put in the order they happen:

  forward     the embedding stage, then each block: the floor under it is the head phase's
              fixed part (parameters, gradients, optimizer state, unsharded copies as the forward
              ends: the model has no phase of its own for a block's forward, and a forward never
              holds more than the same block's backward, which is drawn from its phase); the
              activations are those kept so far (outside the blocks before them, plus each
              block's saved bytes under the plan).
  head        the estimate's head phase (output layer and loss): the activations kept by the
              blocks plus the head's own saved bytes and working set (logits, their fp32 copy
              and gradients), often the step's largest moment.
  backward    each block's phase, last block first, then the embedding stage's backward and
              the root's reduce-scatter.
  optimizer   the optimizer step (no activations).

Shared by the picture (trainer/preflight/plot.py) and its one-line summary (`picture_line`), so the
console, the log and the picture say the same numbers. No matplotlib here.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

GIB = 2 ** 30


@dataclass(frozen=True)
class Segment:
    name: str  # the estimate's phase name, or "<block> forward" for a forward segment
    stage: str  # forward | head | backward | optimizer
    persistent: int  # sharded parameters + optimizer state
    grads: int
    unsharded: int  # FSDP's unsharded copies, reduce-scatter inputs, optimizer temporaries
    activations: int  # kept by the embedding stage and the blocks (and their working sets)
    head: int = 0  # the head's own activations (its saved bytes and working set)

    @property
    def floor(self) -> int:
        return self.persistent + self.grads + self.unsharded

    @property
    def total(self) -> int:
        return self.floor + self.activations + self.head


@dataclass(frozen=True)
class Timeline:
    segments: tuple[Segment, ...]
    floor: int  # under the forward: the head phase's fixed part
    blocks_done: int  # activations when the last block's forward ends, before the head
    head: int  # the head's own activations at its phase
    peak_name: str
    peak: int


def _segment(phase, stage: str, head: int = 0) -> Segment:
    return Segment(phase.name, stage, phase.params + phase.optimizer, phase.grads,
                   phase.unsharded, phase.activations - head, head)


def timeline(outcome) -> Timeline:
    """The step's segments in time order (see the module docstring)."""
    est, profile = outcome.estimate, outcome.profile
    n = len(est.block_saved)
    # estimate() appends the phases in this order: the blocks, the head, the embedding stage's
    # backward, the optimizer step.
    assert len(est.phases) == n + 3, (len(est.phases), n)
    blocks, head, embedding, step = est.phases[:n], est.phases[n], est.phases[n + 1], est.phases[-1]
    held = profile.before_blocks_bytes
    blocks_done = held + sum(est.block_saved)
    # The head phase's activations are the blocks' kept bytes plus the head's own (chain term).
    head_own = head.activations - blocks_done
    below = _segment(head, "forward")  # the forward's floor
    forward = [Segment("embedding stage forward", "forward", below.persistent, below.grads,
                       below.unsharded, held)]
    for plan, saved in zip(outcome.plan, est.block_saved):
        held += saved
        forward.append(Segment(f"{plan.name} forward", "forward", below.persistent, below.grads,
                               below.unsharded, held))
    backward = [_segment(p, "backward") for p in reversed(blocks)] + [
        _segment(embedding, "backward")]
    segments = (*forward, _segment(head, "head", head_own), *backward,
                _segment(step, "optimizer"))
    return Timeline(segments, below.floor, blocks_done, head_own, est.peak.name, est.peak.total)


def gib(n: int) -> str:
    """GiB as the report's tables write it (2 decimals), with 3 significant digits below 1 GiB:
    a small model's step is all in the first hundredth of a GiB."""
    x = n / GIB
    if x >= 1 or n <= 0:
        return f"{x:.2f} GiB"
    # Rounded first, so that int(0.1 * GIB) reads 0.100, not 0.1000.
    return f"{x:.{min(9, 2 - math.floor(math.log10(round(x, 9))))}f} GiB"


def picture_line(outcome, capacity: Optional[int] = None) -> str:
    """The picture in one line: floor + activations by the last block + the head (= the head
    phase), the peak and its phase, and the device's verdict when its size is known."""
    t = timeline(outcome)
    line = (f"memory per rank: floor {gib(t.floor)}, activations up to +{gib(t.blocks_done)} "
            f"by the last block's forward, head +{gib(t.head)}, peak {gib(t.peak)} during "
            f"{t.peak_name}")
    if capacity is None:
        return line
    if t.peak <= capacity:
        return f"{line} (device {gib(capacity)}: fits, {gib(capacity - t.peak)} free)"
    return f"{line} (device {gib(capacity)}: does NOT fit, {gib(t.peak - capacity)} over)"
