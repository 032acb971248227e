"""Surviving faults: preemption signals, bad steps (NaN/inf, loss spikes), stuck collectives.

Decisions that change what every rank does next (stop, skip, roll back) are taken from values
that are identical on all ranks: the all-reduced loss, the global gradient norm, and a per-step
vote (`StepVote`) of the flags each rank saw. No rank ever acts on a local flag alone.
"""

from __future__ import annotations

import contextlib
import math
import os
import signal
import statistics
import sys
import threading
import time
from collections import deque
from dataclasses import dataclass
from typing import Callable, Iterator, Optional, Sequence

import torch
import torch.distributed as dist
from torch import nn

LossFn = Callable[[nn.Module, torch.Tensor, torch.Tensor], torch.Tensor]


class FaultLimit(RuntimeError):
    """The run cannot go on within its fault settings (bad steps, rollbacks); the message names
    the setting and what to change."""

ECHO_WINDOW_S = 2.0  # see PreemptionSignal._handle
REDELIVER_S = 0.01  # see PreemptionSignal._swallowed


class PreemptionSignal:
    """Remembers that SIGTERM, Ctrl-C (SIGINT) or `extra` (e.g. "SIGUSR1") arrived, or that the
    torchrun agent that started this worker is gone; the loop finishes the step, saves and exits.
    The handlers only set a flag: a signal mid-collective must not unwind it. A second Ctrl-C
    stops at once (KeyboardInterrupt, which the entry point turns into one line).

    watch_launcher: poll the parent process; when it changes (the agent was killed, kill -9
    included, and this worker was handed to init), stop as if signalled, within a second.
    """

    def __init__(self, extra: Optional[str], announce: bool = True,
                 watch_launcher: bool = False) -> None:
        self.received: Optional[str] = None
        self.announce = announce
        self.watching = watch_launcher
        # A terminal's Ctrl-C reaches this worker as well as the agent, which passes it on
        # again, only where the two share a process group: torchrun starts each worker in a
        # session of its own, and then a second SIGINT is always the user's second Ctrl-C.
        self._echoes = watch_launcher and _same_process_group_as_parent()
        self._first_sigint = 0.0
        # Set with the second Ctrl-C's KeyboardInterrupt: torch.save writing to a stream (DCP's
        # files) can swallow it in its C++ writer and fail as "unexpected pos" instead, so a
        # save that fails after it is this stop, not a failed save (Trainer.run).
        self.at_once = False
        self._previous = {}
        names = ["SIGTERM", "SIGINT"] + ([extra] if extra and extra not in ("SIGTERM", "SIGINT")
                                         else [])
        for name in names:
            number = getattr(signal, name)
            self._previous[number] = signal.signal(number, self._handle)
        # The other stop signals the entry point caught during start-up (trainer/__main__.py)
        # keep their default action while training: they are not this run's save.signal.
        for name in ("SIGUSR1", "SIGUSR2", "SIGHUP"):
            number = getattr(signal, name)
            if name not in names and signal.getsignal(number) not in (signal.SIG_IGN, None):
                self._previous[number] = signal.signal(number, signal.SIG_DFL)
        self._unraisable = sys.unraisablehook
        sys.unraisablehook = self._swallowed
        self._stop_watch = threading.Event()
        if watch_launcher:
            parent = os.getppid()
            threading.Thread(target=self._watch, args=(parent,), daemon=True,
                             name="blocktrain-launcher-watch").start()

    def _handle(self, number: int, frame: object) -> None:
        name = signal.Signals(number).name
        if name == "SIGINT" and self.received == "SIGINT":
            # Where a Ctrl-C reaches a worker twice (from the terminal and, a moment later,
            # from the agent: see _echoes), only a later one is the user's second Ctrl-C.
            echo = self._echoes and time.monotonic() - self._first_sigint < ECHO_WINDOW_S
            if self.at_once or not echo:
                self.at_once = True
                raise KeyboardInterrupt  # the second Ctrl-C: stop now
            return
        if name == "SIGINT":
            self._first_sigint = time.monotonic()
        if name == "SIGINT" and self.announce:
            print("\nCtrl-C: finishing this step and saving, then exiting (Ctrl-C again to stop "
                  "at once, without saving)", file=sys.stderr, flush=True)
        self.received = self.received or name

    def _swallowed(self, unraisable) -> None:
        """sys.unraisablehook. A handler's KeyboardInterrupt that lands where Python cannot pass
        an exception up (a weakref callback, a __del__) is only printed, "Exception ignored"
        and its trace, and the run goes on: CI saw importlib's module-lock callback take the
        second Ctrl-C mid-save. Deliver the signal again instead, once this hook has returned
        (from here it would land in the hook, swallowed again): a thread sends it to the main
        thread a moment later, where it interrupts a blocking call as the first one did."""
        if self.at_once and issubclass(unraisable.exc_type, KeyboardInterrupt):
            main = threading.main_thread().ident
            try:
                threading.Timer(REDELIVER_S, signal.pthread_kill, (main, signal.SIGINT)).start()
            except RuntimeError:  # no new thread at interpreter shutdown: exiting already
                pass
            return
        self._unraisable(unraisable)

    def _watch(self, parent: int) -> None:
        while not self._stop_watch.wait(0.5):
            if os.getppid() != parent:
                self.received = self.received or "the torchrun agent is gone"
                return

    def restore(self) -> None:
        self._stop_watch.set()
        for number, handler in self._previous.items():
            if handler is not None:  # None: set outside Python, which Python cannot put back
                signal.signal(number, handler)
        self._previous.clear()
        if sys.unraisablehook == self._swallowed:
            sys.unraisablehook = self._unraisable


def _same_process_group_as_parent() -> bool:
    try:
        return os.getpgid(0) == os.getpgid(os.getppid())
    except OSError:
        return False


class StopVote:
    """The decision every rank takes together after a step: stop now (a signal on any rank, a
    lost launcher, `train.stop_at_step`), and whether every rank's async save has finished
    (the checkpointer commits it then). `checkpointer` needs `local_done()` and `poll(all)`.

    A signal or a lost agent can reach some ranks only, and an async save finishes at different
    times on different ranks; without a vote ranks would stop or commit at different steps and
    the next collective would hang. Each rank's ballot (`ballot`) is summed over the ranks in the
    one small all-reduce of host memory the step already makes for its loss (train_step,
    distenv.mean_and_sums), after the backward: a signal arriving later in the step (the update,
    logging, evaluation) is counted at the next step's. Through host memory (gloo), so on a GPU
    it neither waits for the device nor queues behind the step's kernels."""

    def __init__(self, preemption: PreemptionSignal, checkpointer,
                 stop_at_step: Optional[int], steps: int) -> None:
        self.preemption, self.checkpointer = preemption, checkpointer
        self.stop_at_step, self.steps = stop_at_step, steps

    def ballot(self) -> list[int]:
        """This rank's vote, to be summed over the ranks: [signalled, async save not finished]."""
        return [int(self.preemption.received is not None),
                int(not self.checkpointer.local_done())]

    def decide(self, step: int, summed: Sequence[int]) -> Optional[str]:
        """Why every rank stops after `step` (None: go on), from the ballots summed over the
        ranks; commits a finished async save when no rank's is still being written."""
        stop, saved = summed[0] > 0, summed[1] == 0
        self.checkpointer.poll(saved)
        reason = (self.preemption.received or "another rank's signal") if stop else None
        if step == self.stop_at_step and step < self.steps:
            reason = "train.stop_at_step"
        return reason


@dataclass
class Verdict:
    ok: bool  # apply the update
    rollback: bool = False  # go back to the last checkpoint
    reason: str = ""


class LossGuard:
    """Skips non-finite steps, asks for a rollback after `max_bad` in a row or a loss spike.

    A spike is a loss above `spike_factor` x the median of the last `window` good losses, once at
    least `min_history` are known (early losses fall fast and say nothing about spikes).
    """

    def __init__(self, skip_nonfinite: bool, max_bad: int, spike_factor: float, window: int,
                 min_history: int = 10) -> None:
        self.skip_nonfinite, self.max_bad = skip_nonfinite, max_bad
        self.spike_factor, self.min_history = spike_factor, min(min_history, window)
        self.history: deque[float] = deque(maxlen=window)
        self.bad_in_a_row = 0
        self.bad_total = 0

    def judge(self, loss: float, grad_norm: float) -> Verdict:
        if not (math.isfinite(loss) and math.isfinite(grad_norm)):
            if not self.skip_nonfinite:
                return Verdict(True)
            self.bad_in_a_row += 1
            self.bad_total += 1
            reason = f"loss {loss} / grad norm {grad_norm} not finite"
            return Verdict(False, self.bad_in_a_row >= self.max_bad, reason)
        self.bad_in_a_row = 0
        if (self.spike_factor > 0 and len(self.history) >= self.min_history
                and loss > self.spike_factor * statistics.median(self.history)):
            median = statistics.median(self.history)
            return Verdict(False, True, f"loss {loss:.4g} > {self.spike_factor} x median "
                                        f"{median:.4g} of the last {len(self.history)} steps")
        self.history.append(loss)
        return Verdict(True)

    def reset(self) -> None:
        """After a rollback: the history belonged to the abandoned trajectory's tail."""
        self.bad_in_a_row = 0


def injected_loss(loss_fn: LossFn, batch_index: int, nan_at: Sequence[int],
                  spike_at: Sequence[int], hang_at: Sequence[int], hang_s: float, rank: int,
                  world_size: int, slow_at: Sequence[int] = (), slow_s: float = 0.0) -> LossFn:
    """The loss to use for this batch: loss_fn, or a fault injected for tests and drills."""
    if batch_index in slow_at:
        time.sleep(slow_s)  # a slow step on every rank: what throughput drift looks like
    if batch_index in hang_at and rank == world_size - 1:
        time.sleep(hang_s)  # the other ranks' next collective must time out, naming itself
    if batch_index in nan_at:
        return lambda model, *batch: loss_fn(model, *batch) * float("nan")
    if batch_index in spike_at:
        return lambda model, *batch: loss_fn(model, *batch) * 100.0
    return loss_fn


class CollectiveFailure(RuntimeError):
    """A collective timed out or lost a peer; the message names the rank and the operation."""


class TimeoutWatchdog:
    """`with watchdog("saving step 8"):` a timed-out or broken collective inside becomes a
    CollectiveFailure naming this rank, the operation and the timeout to change (the Trainer
    raises the alert on its way out)."""

    def __init__(self, rank: int, timeout_s: int) -> None:
        self.rank, self.timeout_s = rank, timeout_s

    @contextlib.contextmanager
    def __call__(self, operation: str) -> Iterator[None]:
        try:
            yield
        except CollectiveFailure:
            raise
        except Exception as error:
            if is_collective_failure(error):
                raise name_failure(error, self.rank, operation, self.timeout_s) from error
            raise


def is_collective_failure(error: BaseException) -> bool:
    text = str(error).lower()
    return isinstance(error, getattr(dist, "DistError", ())) or any(
        word in text for word in ("timed out", "timeout", "connection closed", "connection reset",
                                  "broken pipe", "socket"))


def name_failure(error: BaseException, rank: int, operation: str,
                 timeout_s: int) -> CollectiveFailure:
    first_line = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
    return CollectiveFailure(
        f"rank {rank}: {operation} failed waiting for the other ranks (timeout "
        f"train.dist_timeout_s={timeout_s}): {first_line}")
