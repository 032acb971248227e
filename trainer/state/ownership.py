"""A run directory has one owner and one history.

`RunLock`: rank 0 holds an exclusive lock on `<run dir>/.lock` for the whole run, so a second
run started on the same directory is refused in one line (naming the host and pid that hold
it) instead of interleaving `metrics.jsonl` and sharing a W&B run. The kernel drops the lock when
the holder ends in any way, kill -9 included, so a stale lock of a dead run is simply taken over;
the file's text only says who held it last.

`set_aside`: `save.resume=false` in a directory that has a history moves that history
(checkpoints, metrics, the W&B run id) into `<run dir>/previous-<time>/`, so a later automatic
resume only ever sees the current run. Nothing is deleted.
"""

from __future__ import annotations

import fcntl
import json
import logging
import os
import socket
import time
from typing import Optional

log = logging.getLogger("trainer")
LOCK_FILE = ".lock"
# Besides the checkpoints: what a run appends to or reuses (trainer/observe/metrics.py, wandb_log.py,
# state.py's stop marker).
# The W&B run id of this run directory, reused by a restarted run (trainer/observe/wandb_log.py).
RUN_ID_FILE = "wandb_run_id"
# The highest W&B step logged in this run directory: a replay is logged after it.
WANDB_STEP_FILE = "wandb_step"
HISTORY = ("metrics.jsonl", "metrics.superseded.jsonl", RUN_ID_FILE, WANDB_STEP_FILE,
           "preempted.json")


class RunDirBusy(RuntimeError):
    """Another live process holds the run directory; `setting` is what names the directory."""

    def __init__(self, message: str, setting: str = "train.run_name") -> None:
        super().__init__(message)
        self.setting = setting


class RunLock:
    def __init__(self, run_dir: str, setting: str = "train.run_name") -> None:
        self.path = os.path.join(run_dir, LOCK_FILE)
        self.setting = setting  # how the user named the directory, for the refusal
        self._fd: Optional[int] = None

    def acquire(self) -> None:
        fd = os.open(self.path, os.O_CREAT | os.O_RDWR, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = _read(fd)
            os.close(fd)
            raise RunDirBusy(
                f"run directory {os.path.dirname(self.path)} is in use by pid "
                f"{holder.get('pid', '?')} on {holder.get('host', '?')} (started "
                f"{holder.get('started', '?')}); wait for that run, or start this one under "
                f"another {self.setting}", self.setting) from None
        except OSError as exc:  # a file system without locks (Lustre mounted without flock)
            os.close(fd)
            log.warning("cannot lock the run directory %s (%s): a second run started on it "
                        "would not be refused", os.path.dirname(self.path), exc)
            return
        os.ftruncate(fd, 0)
        os.pwrite(fd, json.dumps({"host": socket.gethostname(), "pid": os.getpid(),
                                  "started": time.strftime("%Y-%m-%d %H:%M:%S")}).encode(), 0)
        self._fd = fd

    def release(self) -> None:
        if self._fd is not None:
            os.close(self._fd)  # the lock goes with the descriptor; the file may stay
            self._fd = None


def _read(fd: int) -> dict:
    try:
        return json.loads(os.pread(fd, 4096, 0).decode() or "{}")
    except ValueError:
        return {}


def set_aside(run_dir: str, checkpoint_dir: str) -> list[str]:
    """Move an earlier history out of the way of a fresh start; returns where it went. Moves
    stay on their file system: a `save.dir` outside the run directory is renamed beside itself."""
    stamp = time.strftime("previous-%Y%m%d-%H%M%S")
    within = os.path.dirname(os.path.abspath(checkpoint_dir)) == os.path.abspath(run_dir)
    inside = [os.path.join(run_dir, name) for name in HISTORY]
    inside += [checkpoint_dir] if within else []
    found = [p for p in inside if os.path.exists(p) and not _empty_dir(p)]
    moved = []
    if found:
        target = _fresh(os.path.join(run_dir, stamp))
        os.makedirs(target)
        for path in found:
            os.replace(path, os.path.join(target, os.path.basename(path.rstrip(os.sep))))
        moved.append(target)
    if not within and os.path.isdir(checkpoint_dir) and not _empty_dir(checkpoint_dir):
        target = _fresh(checkpoint_dir.rstrip(os.sep) + "-" + stamp)
        os.replace(checkpoint_dir, target)
        moved.append(target)
    return moved


def _empty_dir(path: str) -> bool:
    return os.path.isdir(path) and not os.listdir(path)


def _fresh(path: str) -> str:
    suffix = 0
    while os.path.exists(path + (f"-{suffix}" if suffix else "")):
        suffix += 1
    return path + (f"-{suffix}" if suffix else "")


# Run directories this process locked before Hydra wrote into them (see claim), by real path.
_claimed: dict[str, RunLock] = {}


def claim(run_dir: str, setting: str) -> None:
    """Lock the run directory before anything is written into it (Hydra's .hydra/ files and
    train.log come before the run starts): a refused run must not touch a live run's records.
    Raises RunDirBusy; own_run_dir takes the lock over."""
    os.makedirs(run_dir, exist_ok=True)
    lock = RunLock(run_dir, setting)
    lock.acquire()
    _claimed[os.path.realpath(run_dir)] = lock


def own_run_dir(run_dir: str, is_main: bool, fresh_start: bool,
                checkpoint_dir: str) -> Optional[RunLock]:
    """Rank 0 locks the run directory (every rank learns whether it could) and, for a fresh
    start (`save.resume=false`) in a directory with a history, sets that history aside."""
    import torch.distributed as dist  # here: the CLI imports this module before torch is needed

    lock, outcome = None, [None]
    if is_main:
        lock = _claimed.pop(os.path.realpath(run_dir), None)
        try:
            if lock is None:
                lock = RunLock(run_dir)
                lock.acquire()
            if fresh_start:
                moved = set_aside(run_dir, checkpoint_dir)
                if moved:
                    log.warning("save.resume=false: starting over; the earlier checkpoints and "
                                "metrics of this run directory were moved to %s",
                                " and ".join(moved))
        except RunDirBusy as exc:
            outcome = [str(exc)]
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.broadcast_object_list(outcome, src=0)
    if outcome[0] is not None:
        raise RunDirBusy(outcome[0], lock.setting if lock is not None else "train.run_name")
    return lock
