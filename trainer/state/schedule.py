"""The save schedule: every `save.every` steps, at the end (`save.at_end`), and whenever the run
stops early. The loop calls `save` after every step; this decides, so a run that never saves
periodically costs nothing here."""

from __future__ import annotations

from typing import Optional

from trainer.config import SaveConfig
from trainer.faults import TimeoutWatchdog
from trainer.state.checkpoint import Checkpointer, checkpoint_path
from trainer.state.resume import ModelState, Progress, RunRecord


class SaveSchedule:
    def __init__(self, save: SaveConfig, steps: int, checkpointer: Checkpointer,
                 watchdog: TimeoutWatchdog, record: RunRecord) -> None:
        self.every, self.at_end, self.steps = save.every, save.at_end, steps
        self.checkpointer, self.record = checkpointer, record
        self.watchdog = watchdog  # names the step if a rank stops answering

    def should_save(self, step: int, stopping: bool) -> bool:
        return (stopping or (self.every > 0 and step % self.every == 0)
                or (self.at_end and step == self.steps))

    def save(self, step: int, stopping: bool, model: ModelState, progress: Progress) -> None:
        """Save this step's checkpoint if it is due: the model, its optimizer, and the rest of
        the run's state (progress, schedule, layout). A stopping run waits for the save (an
        async one included) to be committed."""
        if not self.should_save(step, stopping):
            return
        with self.watchdog(f"saving the checkpoint of step {step}"):
            self.checkpointer.save(step, model.model, model.optimizer,
                                   self.record.state(progress, model.scheduler))
        if stopping:
            self.checkpointer.wait()

    def last(self) -> tuple[Optional[int], Optional[str]]:
        """The last committed step and its folder (None, None before the first)."""
        step = self.checkpointer.last_committed
        return step, None if step is None else checkpoint_path(self.checkpointer.root, step)
