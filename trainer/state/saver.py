"""When the run saves: every `save.every` steps, at the end (`save.at_end`), and whenever the run
stops early. The loop calls `save` after every step; this decides, so a run that never saves
periodically costs nothing here."""

from __future__ import annotations

from typing import Callable, ContextManager, Optional

import torch
from torch import nn

from trainer.state.checkpoint import Checkpointer, checkpoint_path


class Saver:
    def __init__(self, checkpointer: Checkpointer, every: int, at_end: bool, steps: int,
                 collectives: Callable[[str], ContextManager]) -> None:
        self.checkpointer, self.every, self.at_end, self.steps = checkpointer, every, at_end, steps
        self.collectives = collectives  # names the step if a rank stops answering

    def should_save(self, step: int, stopping: bool) -> bool:
        return (stopping or (self.every > 0 and step % self.every == 0)
                or (self.at_end and step == self.steps))

    def save(self, step: int, stopping: bool, model: nn.Module,
             optimizer: torch.optim.Optimizer, state: Callable[[], dict]) -> None:
        """Save this step's checkpoint if it is due; `state()` is the rest of the run's state
        (progress, scheduler, layout), asked for only then. A stopping run waits for the save
        (an async one included) to be committed."""
        if not self.should_save(step, stopping):
            return
        with self.collectives(f"saving the checkpoint of step {step}"):
            self.checkpointer.save(step, model, optimizer, state())
        if stopping:
            self.checkpointer.wait()

    def last(self) -> tuple[Optional[int], Optional[str]]:
        """The last committed step and its folder (None, None before the first)."""
        step = self.checkpointer.last_committed
        return step, None if step is None else checkpoint_path(self.checkpointer.root, step)
