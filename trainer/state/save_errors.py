"""A checkpoint save that fails (a full disk above all): one line that says where, which step and
which checkpoint is still good, and no torn folder left to fill the disk further."""

from __future__ import annotations

import errno
import os
import shutil
from typing import Iterator, Optional

# sysexits' EX_IOERR: distinct from a configuration mistake (2), a preemption (75) and a crash
# (1), so a launcher or a script can tell "the disk is full" apart.
SAVE_FAILED_EXIT = 74


class SaveFailed(RuntimeError):
    """A checkpoint could not be written; the message says what to do."""


def _errors_in(error: BaseException) -> Iterator[BaseException]:
    """The error, its causes, and DCP's per-rank failures, each once."""
    seen: set[int] = set()
    stack: list[BaseException] = [error]
    while stack:
        exc = stack.pop()
        if id(exc) in seen:
            continue
        seen.add(id(exc))
        yield exc
        stack += [e for e in (exc.__cause__, exc.__context__) if e is not None]
        failures = getattr(exc, "failures", None)  # DCP's CheckpointException: rank -> error
        if isinstance(failures, dict):  # (error, its traceback) for each failed rank
            for failure in failures.values():
                first = failure[0] if isinstance(failure, tuple) and failure else failure
                if isinstance(first, BaseException):
                    stack.append(first)


def is_no_space(error: BaseException) -> bool:
    """ENOSPC (or a quota) anywhere in the error, its causes, or DCP's per-rank failures."""
    if any(isinstance(e, OSError) and e.errno in (errno.ENOSPC, errno.EDQUOT)
           for e in _errors_in(error)):
        return True
    return "No space left on device" in str(error) or "Disk quota exceeded" in str(error)


def was_interrupted(error: BaseException) -> bool:
    """A Ctrl-C (KeyboardInterrupt) ended the save, maybe wrapped by DCP: not a failed save."""
    return any(isinstance(e, KeyboardInterrupt) for e in _errors_in(error))


def looks_full(path: str) -> bool:
    """Whether the file system of `path` is (nearly) out of room, checked right after a write
    failed: torch.save's zip writer reports a full disk only as "unexpected pos ...", without
    the ENOSPC it met, and a write that fails for want of room has used up what was left."""
    try:
        usage = shutil.disk_usage(mount_point(path))
    except OSError:
        return False
    return usage.free < max(1 << 20, usage.total // 100)


def mount_point(path: str) -> str:
    path = os.path.abspath(path)
    while not os.path.ismount(path):
        path = os.path.dirname(path)
    return path


def save_failure(error: BaseException, step: int, folder: str, last_good: Optional[int],
                 full: bool = False) -> SaveFailed:
    """full: looks_full(folder) as measured before the torn folder was removed."""
    good = (f"the last good checkpoint is step {last_good}" if last_good is not None
            else "no checkpoint of this run is complete yet")
    if full or is_no_space(error):
        return SaveFailed(f"no space left on {mount_point(folder)} while saving step {step} to "
                          f"{folder}; {good}. Free space (or set save.dir elsewhere) and start "
                          "the same run again to continue from it")
    first = (str(error).strip().splitlines() or [type(error).__name__])[-1][:300]
    return SaveFailed(f"saving step {step} to {folder} failed ({first}); {good}")
