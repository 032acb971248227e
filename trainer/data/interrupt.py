"""Stopping while the data is being tokenized: a line and a status, nothing half-written.

While a cache folder is written `stop_signals` turns SIGTERM and the other stop signals (SIGUSR1,
the default `save.signal`, which Slurm sends before the time limit; SIGUSR2, SIGHUP) into
`PrepareStopped` (status 75, as a preemption: start it again) and Ctrl-C into the same with
status 130; the writer's `finally` removes its temporary folder on the way out, so the cache
holds only whole folders. Before and after that block the entry point's own handlers stop the
process at once with a line (trainer/__main__.py): nothing is being written then.

With data.num_proc > 1, `datasets` forks workers (and a manager process) inside the block. They
leave stopping to this process, which ends the pool on its way out: forked there, they ignore
the stop signals a whole process group receives (Ctrl-C, Slurm's) and end by SIGTERM, which is
how the pool ends them; they unwind to end (a worker killed outright while it waits for a task
takes the queue's lock with it, and the pool's clean-up then hangs the group: SIGTERM to the
whole group did). Stopping while the pool works, `datasets`' own clean-up raises (a
TimeoutError waiting for results that will not come) over our stop: the stop is found in the
exception's context, so it is still the line and the status.
"""

from __future__ import annotations

import contextlib
import os
import signal
import threading
from typing import Iterator, Optional

STOPPED_EXIT = 75  # EX_TEMPFAIL: stopped, run it again (the preemption status)
INTERRUPTED_EXIT = 130  # Ctrl-C


# The signals that stop the preparation: SIGTERM, Ctrl-C, and the choices of save.signal.
STOPS = (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1, signal.SIGUSR2, signal.SIGHUP)


class PrepareStopped(Exception):
    """Stopped by a signal while tokenizing; `status` is the exit status, the message the line."""

    def __init__(self, message: str, status: int) -> None:
        super().__init__(message)
        self.status = status


class _Stopped(BaseException):
    """Raised from the handlers; a BaseException so no `except Exception` in a library swallows
    it on the way out."""

    def __init__(self, number: int) -> None:
        super().__init__(number)
        self.number = number


_preparing = False  # inside stop_signals' block: a process forked now is a worker of ours


def _worker_ends(signum, frame) -> None:
    """A worker's SIGTERM: unwind and exit. Unwinding releases the locks it holds: an idle pool
    worker holds its task queue's read lock while it waits, and one killed outright takes that
    lock with it, so the pool's own clean-up in the parent (which takes the lock) waits forever.
    Once: the pool's SIGTERM after the group's waits for this unwinding."""
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    raise SystemExit(128 + signum)


def _quiet_worker() -> None:
    """In a process forked inside the block: stopping is the parent's to do."""
    if not _preparing:
        return
    try:
        for number in STOPS:
            signal.signal(number, _worker_ends if number == signal.SIGTERM else signal.SIG_IGN)
    except ValueError:  # not this interpreter's main thread: leave it as it is
        pass


os.register_at_fork(after_in_child=_quiet_worker)


def _stop_in(exc: Optional[BaseException]) -> Optional[int]:
    """The stop signal behind `exc`: raised by our handler, or in the context of an exception
    a library's clean-up raised on the way out; None for any other exception."""
    seen = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        if isinstance(exc, _Stopped):
            return exc.number
        if isinstance(exc, KeyboardInterrupt):
            return signal.SIGINT
        exc = exc.__cause__ or exc.__context__
    return None


@contextlib.contextmanager
def stop_signals(path: str) -> Iterator[None]:
    """SIGTERM, Ctrl-C and the other STOPS inside the block end it with PrepareStopped naming
    `path`."""
    main = threading.current_thread() is threading.main_thread()

    def stopped(signum, frame) -> None:
        raise _Stopped(signum)

    numbers = [n for n in STOPS if signal.getsignal(n) is not signal.SIG_IGN]
    previous = {n: signal.signal(n, stopped) for n in numbers} if main else {}
    tail = (f"while tokenizing {path}: nothing was cached (the partial folder is removed); "
            "start the same run again to tokenize it")
    global _preparing
    was, _preparing = _preparing, True
    try:
        yield
    except BaseException as exc:
        number = _stop_in(exc)
        if number is None:
            raise
        if number != signal.SIGINT:
            raise PrepareStopped(f"stopped by {signal.Signals(number).name} {tail}",
                                 STOPPED_EXIT) from None
        raise PrepareStopped(f"interrupted {tail}", INTERRUPTED_EXIT) from None
    finally:
        _preparing = was
        for number, handler in previous.items():
            # None: a handler set outside Python, which Python cannot put back; ours (the
            # entry point's) is what was there when this process is the trainer.
            signal.signal(number, signal.SIG_DFL if handler is None else handler)
