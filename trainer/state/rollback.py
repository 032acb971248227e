"""A step the loss guard refused (trainer/faults.py's LossGuard): count it, alert, and when the
guard asks, roll back to the last committed checkpoint, keeping the data position (the batches
read since are skipped: they led here). Past the fault settings the run stops with FaultLimit
naming the setting to change."""

from __future__ import annotations

from typing import Optional, Protocol

from trainer.faults import FaultLimit, LossGuard, Verdict
from trainer.state.checkpoint import Checkpointer
from trainer.state.resume import ModelState, Progress, restore


class RunRecorder(Protocol):
    """What a rollback tells the run's log (trainer/observe/metrics.py's RunLogger is one): the
    type lives here, below the logger, so state/ never reaches up into observe/."""

    def record(self, metrics: dict, console: bool = True,
               wandb_step: Optional[int] = None) -> bool: ...

    def rewind(self, step: int) -> None: ...

    def info(self, message: str) -> None: ...


class AlertSink(Protocol):
    """Where a rollback raises its alerts (trainer/observe/watch.py's Alerts is one)."""

    def fire(self, kind: str, step: int, text: str, level: str = "WARN",
             wandb_step: Optional[int] = None) -> bool: ...


def rollback(checkpointer: Checkpointer, model: ModelState,
             progress: Progress) -> Optional[Progress]:
    """Back to the last committed checkpoint, keeping the data position. None when there is
    no checkpoint to go back to."""
    checkpointer.wait()
    loaded = checkpointer.load_latest(model.model, model.optimizer)
    if loaded is None:
        return None
    restored = restore(loaded, model.scheduler)
    restored.batch_index = progress.batch_index
    restored.skipped_steps = progress.skipped_steps
    restored.rollbacks = progress.rollbacks + 1
    return restored


class Rollback:
    """What the loop does with a refused step: `after_bad_step` returns where the run stands
    next (the same progress, or the checkpoint's)."""

    def __init__(self, checkpointer: Checkpointer, model: ModelState, guard: LossGuard,
                 logger: RunRecorder, alerts: AlertSink, max_rollbacks: int) -> None:
        self.checkpointer, self.model, self.guard = checkpointer, model, guard
        self.logger, self.alerts, self.max_rollbacks = logger, alerts, max_rollbacks

    def after_bad_step(self, verdict: Verdict, step: int, progress: Progress) -> Progress:
        progress.skipped_steps += 1
        logger, wandb_step = self.logger, progress.batch_index
        logger.record({"step": step, "skipped_step": 1, "skipped_steps": progress.skipped_steps,
                       "reason": verdict.reason}, wandb_step=wandb_step)
        kind = "nonfinite" if "not finite" in verdict.reason else "loss_spike"
        self.alerts.fire(kind, step, f"step {step} skipped: {verdict.reason}",
                         wandb_step=wandb_step)
        if not verdict.rollback:
            return progress
        if progress.rollbacks >= self.max_rollbacks:
            raise FaultLimit(f"faults.max_rollbacks: {self.max_rollbacks} rollbacks already, and "
                             f"again {verdict.reason} at step {step}; lower optim.lr or inspect "
                             "the data")
        restored = rollback(self.checkpointer, self.model, progress)
        if restored is None:
            guard = self.guard
            if guard.bad_in_a_row >= guard.max_bad:
                raise FaultLimit(f"faults.max_bad_steps: {guard.bad_in_a_row} bad steps in a "
                                 f"row ({verdict.reason}) and no checkpoint to roll back to; "
                                 "lower optim.lr, or save earlier with save.every")
            logger.info(f"step {step}: {verdict.reason}; no checkpoint to roll back to, the "
                        "update was skipped")
            return progress
        self.guard.reset()
        logger.rewind(restored.step)
        logger.record({"step": restored.step, "rollback_from_step": step,
                       "rollbacks": restored.rollbacks, "reason": verdict.reason},
                      wandb_step=wandb_step)
        self.alerts.fire("rollback", restored.step, f"rolled back from step {step} to the "
                         f"checkpoint of step {restored.step} ({verdict.reason})",
                         level="ERROR", wandb_step=wandb_step)
        logger.info(f"rolled back from step {step} to the checkpoint of step {restored.step} "
                    f"({verdict.reason}); the batches read since are skipped")
        return restored
