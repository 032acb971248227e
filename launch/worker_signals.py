"""Signals to torchrun's workers, and whether they can take one yet.

A worker's interpreter turns Ctrl-C into a KeyboardInterrupt from its very start, before the
trainer's first line installs the handlers that stop a run with one line: a SIGINT passed on in
that window (its `site` imports; a loaded machine stretches it past a second) ends the worker
with Python's own trace ("Fatal Python error: init_import_site") and status 1, which reads as a
crash. So a stop signal goes to a worker once it handles SIGTERM (the trainer's entry does so
from its first line; Python by itself never does), or once its start is long past (an entry
that never handles SIGTERM still gets the signal), or where /proc cannot say (not Linux).
"""

from __future__ import annotations

import os
import signal
import time
from typing import Iterable, Optional

from trainer.state.rundir import process_start_time

# Past this age a worker gets a stop signal whether or not it handles SIGTERM: an interpreter's
# start takes well under it, even on a loaded machine.
STARTING_S = 5.0
_POLL_S = 0.02


def send(pids: Iterable[int], sig: signal.Signals) -> None:
    for pid in pids:
        try:
            os.killpg(pid, sig)  # each worker leads its own process group, as torchrun makes it
        except ProcessLookupError:
            pass


def exited(pid: int) -> bool:
    """Whether the worker has ended, without reaping it (the agent reads its status)."""
    try:
        return os.waitid(os.P_PID, pid, os.WEXITED | os.WNOHANG | os.WNOWAIT) is not None
    except ChildProcessError:  # reaped already
        return True


def wait_for_exit(pids: Iterable[int], seconds: Optional[float]) -> None:
    """Until every pid has ended, or `seconds` (None: no limit; signals still act meanwhile)."""
    pids = list(pids)
    deadline = None if seconds is None else time.monotonic() + seconds
    while not all(exited(pid) for pid in pids):
        if deadline is not None and time.monotonic() >= deadline:
            return
        time.sleep(0.05)


def handles_sigterm(pid: int) -> Optional[bool]:
    """Whether the process has a handler for SIGTERM (its /proc status), None where unknown."""
    try:
        with open(f"/proc/{pid}/status") as f:
            caught = next((line.split()[1] for line in f if line.startswith("SigCgt:")), None)
    except OSError:
        return None
    return None if caught is None else bool(int(caught, 16) >> (signal.SIGTERM - 1) & 1)


def age_s(pid: int) -> Optional[float]:
    """Seconds since the process started (/proc), None where unknown."""
    started_at = process_start_time(pid)
    return None if started_at is None else time.time() - started_at


def started(pid: int) -> bool:
    """Whether a stop signal can go to the worker now (the module's docstring)."""
    if exited(pid) or handles_sigterm(pid) is not False:
        return True
    age = age_s(pid)
    return age is None or age >= STARTING_S


def send_once_started(pids: Iterable[int], sig: signal.Signals) -> None:
    """`sig` to each worker, each as soon as it has started (at most STARTING_S from now)."""
    waiting = list(pids)
    deadline = time.monotonic() + STARTING_S
    while waiting:
        ready = [pid for pid in waiting if time.monotonic() >= deadline or started(pid)]
        send(ready, sig)
        waiting = [pid for pid in waiting if pid not in ready]
        if waiting:
            time.sleep(_POLL_S)
