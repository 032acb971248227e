"""Stopping while the data is being tokenized: a line and a status, nothing half-written.

While a cache folder is written `stop_signals` turns SIGTERM and the other stop signals (SIGUSR1,
the default `save.signal`, which Slurm sends before the time limit; SIGUSR2, SIGHUP) into
`PrepareStopped` (status 75, as a preemption: start it again) and Ctrl-C into the same with
status 130; the writer's `finally` removes its temporary folder on the way out, so the cache
holds only whole folders. Before and after that block the entry point's own handlers stop the
process at once with a line (trainer/__main__.py): nothing is being written then.

With data.num_proc > 1, `datasets` forks workers (and a manager process) inside the block. They
leave stopping to this process, which ends the pool on its way out: forked there, they ignore
the stop signals, each in a process group of its own (a signal to the whole group reaches this
process alone: see _quiet_worker), and end by SIGTERM, which is how the pool ends them. Stopping
while the pool works, `datasets`' own clean-up raises (a TimeoutError waiting for results that
will not come) over our stop: the stop is found in the exception's context, so it is still the
line and the status. What the block started and is
still running when it ends (the manager, when the stop came while `datasets` handled a result
outside the generator that shuts it down) is ended there: the exit would wait for it.
Out of this process's group, they would outlive it were it killed outright (SIGKILL, which no
handler sees): on Linux each asks the kernel for SIGKILL when the thread that forked it ends
(prctl PR_SET_PDEATHSIG; the pool and the manager are forked by the main thread), so they end
with this process; elsewhere they are left to the scheduler's clean-up.
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
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
_forker = 0  # the pid that last forked (set before each fork): a worker's parent
PR_SET_PDEATHSIG = 1  # linux/prctl.h


def _prctl():
    """libc's prctl on Linux (found once, here, not in each worker); None elsewhere."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        import ctypes

        return ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):  # no libc to ask: left to the scheduler's clean-up
        return None


_PRCTL = _prctl()


def _die_with_parent() -> None:
    """Linux: this process gets SIGKILL when the thread that forked it ends; at once if the
    parent is already gone (it died between the fork and the request)."""
    if _PRCTL is None or _PRCTL(PR_SET_PDEATHSIG, int(signal.SIGKILL), 0, 0, 0) != 0:
        return
    if os.getppid() != _forker:
        os._exit(128 + signal.SIGKILL)


def _quiet_worker() -> None:
    """In a process forked inside the block: stopping is the parent's to do. It leaves the
    parent's process group, so a signal to the whole group (a scheduler's, a terminal's) reaches
    the parent alone, which ends its workers the pool's own way (SIGTERM, after the idle ones
    took their sentinel). Killed with the group, an idle worker took the pool's task-queue lock
    with it and the pool's clean-up waited for it forever; and the pool forked replacements of
    the dead that then waited for the lock too."""
    if not _preparing:
        return
    _die_with_parent()
    try:
        os.setpgid(0, 0)
        for number in STOPS:
            signal.signal(number, signal.SIG_DFL if number == signal.SIGTERM else signal.SIG_IGN)
    except ValueError:  # not this interpreter's main thread: leave it as it is
        pass


def _children() -> set:
    """The live processes this one started with multiprocess (`datasets`' pool and manager)
    or multiprocessing."""
    found = set()
    for name in ("multiprocess", "multiprocessing"):
        module = sys.modules.get(name)
        if module is not None:
            found.update(module.active_children())
    return found


def _end_new(children: set) -> None:
    """End what the block started that outlived it. Stopped while `datasets` handles a result,
    its manager (a child the exit waits for) is left running: the generator that would shut it
    down is not closed on the way out."""
    left = [child for child in _children() if child not in children]
    for child in left:
        child.terminate()
    for child in left:
        child.join(timeout=5)
        if child.is_alive():
            child.kill()
            child.join()


_forking = False  # the main thread is in os.fork's hooks, where a raised exception is dropped
_deferred: list = []  # stops that came meanwhile


def _fork_begins() -> None:
    global _forking, _forker
    _forker = os.getpid()
    _forking = _preparing and threading.current_thread() is threading.main_thread()


def _fork_ends() -> None:
    """In the parent, after the other hooks (logging's): a stop that came while forking is sent
    again once the hooks are over (raised in one, the exception was dropped and the stop lost:
    the preparation then waited for the stuck work forever)."""
    global _forking
    _forking = False
    if _deferred:
        threading.Timer(0.05, os.kill, (os.getpid(), _deferred.pop())).start()
        _deferred.clear()


os.register_at_fork(before=_fork_begins, after_in_child=_quiet_worker,
                    after_in_parent=_fork_ends)


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

    owner = os.getpid()

    def stopped(signum, frame) -> None:
        if os.getpid() != owner:
            # A worker just forked, before _quiet_worker set its own handlers: a signal this
            # process had not yet handled when the pool forked it from another thread, or the
            # pool's SIGTERM. It holds nothing yet: gone at once (raised, the fork hook drops
            # the exception and the worker waits forever for the pool's task-queue lock, which
            # the pool's clean-up holds).
            os._exit(128 + signum)
        if _forking:
            _deferred.append(signum)
            return
        raise _Stopped(signum)

    numbers = [n for n in STOPS if signal.getsignal(n) is not signal.SIG_IGN]
    previous = {n: signal.signal(n, stopped) for n in numbers} if main else {}
    tail = (f"while tokenizing {path}: nothing was cached (the partial folder is removed); "
            "start the same run again to tokenize it")
    global _preparing
    was, _preparing = _preparing, True
    children = _children()
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
        _end_new(children)
        for number, handler in previous.items():
            # None: a handler set outside Python, which Python cannot put back; ours (the
            # entry point's) is what was there when this process is the trainer.
            signal.signal(number, signal.SIG_DFL if handler is None else handler)
