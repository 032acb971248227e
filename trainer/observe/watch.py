"""Watching the run: alerts for faults and drift, and what the loop does about a bad step.

An alert is what a person should hear about rather than find later in a log: a NaN/inf step
skipped, a loss spike, a rollback, a preemption and the requeued start after it, a collective
that timed out, tokens/s falling below a fraction of its running median, memory above the
predicted peak. Each one becomes, on rank 0:

- an `alert` line in metrics.jsonl (always, also when rate-limited: `"sent": false`);
- a console / train.log line starting with `ALERT` (when not rate-limited);
- a W&B alert (`run.alert`: e-mail/Slack when online, kept in the offline run file otherwise)
  and an `alert/<kind>` point in the W&B history, so a dashboard panel shows when it happened.

Alerts of one kind are rate-limited to one per `logging.alert_interval_s`.
"""

from __future__ import annotations

import math
import statistics
import time
from collections import deque
from typing import Callable, Optional

import torch
from torch import nn

from trainer.faults import FaultLimit, LossGuard, Verdict
from trainer.observe.metrics import RunLogger
from trainer.state.resume import Progress, rollback

KINDS = ("nonfinite", "loss_spike", "rollback", "preemption", "resumed", "collective_timeout",
         "throughput", "memory")


class Alerts:
    def __init__(self, logger: RunLogger, interval_s: float,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.logger, self.interval_s, self.clock = logger, interval_s, clock
        self._last: dict[str, float] = {}
        self.counts: dict[str, int] = {}

    def fire(self, kind: str, step: int, text: str, level: str = "WARN",
             wandb_step: Optional[int] = None) -> bool:
        """Record the alert; send it unless one of this kind was sent within the interval."""
        assert kind in KINDS, kind
        now = self.clock()
        sent = now - self._last.get(kind, -math.inf) >= self.interval_s
        if sent:
            self._last[kind] = now
        self.counts[kind] = self.counts.get(kind, 0) + 1
        self.logger.alert(kind, step, text, level, sent, wandb_step)
        return sent


class ThroughputWatch:
    """Tokens/s below `fraction` of the median of the last `window` normal steps is drift.

    The first `warmup` steps (compiling, allocator and data warm-up) are not counted, and a slow
    step is not added to the history, so a long slow spell keeps alerting instead of becoming
    the new normal. fraction 0 turns it off."""

    def __init__(self, fraction: float, window: int, warmup: int = 2) -> None:
        self.fraction, self.warmup = fraction, warmup
        self.history: deque[float] = deque(maxlen=window)

    def check(self, tokens_per_s: float) -> Optional[str]:
        if self.fraction <= 0:
            return None
        if self.warmup > 0:
            self.warmup -= 1
            return None
        if len(self.history) >= min(5, self.history.maxlen or 5):
            median = statistics.median(self.history)
            if tokens_per_s < self.fraction * median:
                return (f"throughput fell to {tokens_per_s:,.0f} tokens/s, below "
                        f"{self.fraction:g} x the running median {median:,.0f} "
                        "(logging.alert_throughput_fraction)")
        self.history.append(tokens_per_s)
        return None


def memory_text(measured: int, predicted: Optional[int], margin: float,
                what: str) -> Optional[str]:
    """The alert text when `measured` bytes exceed the prediction by more than `margin`."""
    if predicted is None or predicted <= 0 or margin < 0 or measured <= predicted * (1 + margin):
        return None
    return (f"{what} {measured / 2**30:.3f} GiB is {measured / predicted - 1:.0%} above the "
            f"predicted peak {predicted / 2**30:.3f} GiB (logging.alert_memory_margin={margin:g})")


def bad_step(verdict: Verdict, step: int, progress: Progress, checkpointer, model: nn.Module,
             optimizer: torch.optim.Optimizer, scheduler, guard: LossGuard, logger: RunLogger,
             alerts: Alerts, max_rollbacks: int) -> Progress:
    """A step the guard refused: count it, alert, roll back if it asked and a checkpoint
    exists."""
    progress.skipped_steps += 1
    logger.record({"step": step, "skipped_step": 1, "skipped_steps": progress.skipped_steps,
                   "reason": verdict.reason}, wandb_step=progress.batch_index)
    kind = "nonfinite" if "not finite" in verdict.reason else "loss_spike"
    alerts.fire(kind, step, f"step {step} skipped: {verdict.reason}",
                wandb_step=progress.batch_index)
    if not verdict.rollback:
        return progress
    if progress.rollbacks >= max_rollbacks:
        raise FaultLimit(f"faults.max_rollbacks: {max_rollbacks} rollbacks already, and again "
                         f"{verdict.reason} at step {step}; lower optim.lr or inspect the data")
    restored = rollback(checkpointer, model, optimizer, scheduler, progress)
    if restored is None:
        if guard.bad_in_a_row >= guard.max_bad:
            raise FaultLimit(f"faults.max_bad_steps: {guard.bad_in_a_row} bad steps in a row "
                             f"({verdict.reason}) and no checkpoint to roll back to; lower "
                             "optim.lr, or save earlier with save.every")
        logger.info(f"step {step}: {verdict.reason}; no checkpoint to roll back to, the update "
                    "was skipped")
        return progress
    guard.reset()
    logger.rewind(restored.step)
    logger.record({"step": restored.step, "rollback_from_step": step,
                   "rollbacks": restored.rollbacks, "reason": verdict.reason},
                  wandb_step=progress.batch_index)
    alerts.fire("rollback", restored.step, f"rolled back from step {step} to the checkpoint of "
                f"step {restored.step} ({verdict.reason})", level="ERROR",
                wandb_step=progress.batch_index)
    logger.info(f"rolled back from step {step} to the checkpoint of step {restored.step} "
                f"({verdict.reason}); the batches read since are skipped")
    return restored
