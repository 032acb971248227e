"""Watching the run: alerts for faults and drift.

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

from trainer.observe.metrics import RunLogger

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
