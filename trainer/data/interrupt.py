"""Stopping while the data is being tokenized: a line and a status, nothing half-written.

Before the model's training loop exists, SIGTERM would end the process with the kernel's 143 and
no word, and Ctrl-C at once (trainer/__main__.py). While a cache folder is written `stop_signals`
turns SIGTERM into `PrepareStopped` (status 75, as a preemption: start it again) and Ctrl-C into
the same with status 130; the writer's `finally` removes its temporary folder on the way out, so
the cache holds only whole folders.
"""

from __future__ import annotations

import contextlib
import signal
import threading
from typing import Iterator

STOPPED_EXIT = 75  # EX_TEMPFAIL: stopped, run it again (the preemption status)
INTERRUPTED_EXIT = 130  # Ctrl-C


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


@contextlib.contextmanager
def stop_signals(path: str) -> Iterator[None]:
    """SIGTERM and Ctrl-C inside the block end it with PrepareStopped naming `path`."""
    main = threading.current_thread() is threading.main_thread()

    def stopped(signum, frame) -> None:
        raise _Stopped(signum)

    numbers = [signal.SIGTERM] + ([signal.SIGINT] if signal.getsignal(signal.SIGINT)
                                  is not signal.SIG_IGN else [])
    previous = {n: signal.signal(n, stopped) for n in numbers} if main else {}
    tail = (f"while tokenizing {path}: nothing was cached (the partial folder is removed); "
            "start the same run again to tokenize it")
    try:
        yield
    except (_Stopped, KeyboardInterrupt) as exc:
        if getattr(exc, "number", signal.SIGINT) == signal.SIGTERM:
            raise PrepareStopped(f"stopped by SIGTERM {tail}", STOPPED_EXIT) from None
        raise PrepareStopped(f"interrupted {tail}", INTERRUPTED_EXIT) from None
    finally:
        for number, handler in previous.items():  # None: set outside Python, the default
            signal.signal(number, signal.SIG_DFL if handler is None else handler)
