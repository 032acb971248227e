"""Two programs taking turns, step by step, so that a slow spell of the machine falls on both.

Used by `python -m launch.bench --reference` (launch/bench/reference.py) through
launch/bench/stepcount.py. Each rank of the program that starts first ("first") and the same
rank of the other ("second") share two named pipes in one folder: `a<rank>`, written by the
first, and `b<rank>`, written by the second. At the end of every optimizer step a program hands
the turn over (one byte) and blocks until it comes back, so only one program computes at a time
and the two alternate a step each. The seconds spent blocked are taken out of the program's own
clock (`waited`), and the CPU its other threads used meanwhile (a prefetcher, gloo, OpenMP
spinning down) is kept (`cpu_while_waiting`): work that overlapped the other program's step.

The first program marks `ready<rank>` at the end of its first step, before it blocks; the bench
starts the second only when every rank is ready, so each program also starts up alone. A program
that ends, or dies, closes its pipes; the other then reads end-of-file and stops waiting.
"""

from __future__ import annotations

import os
import time


def make(folder: str, ranks: int) -> None:
    """The pipes for `ranks` ranks, in a new folder."""
    os.makedirs(folder)
    for rank in range(ranks):
        os.mkfifo(os.path.join(folder, f"a{rank}"))
        os.mkfifo(os.path.join(folder, f"b{rank}"))


def ready(folder: str, ranks: int) -> bool:
    """Whether every rank of the first program has ended its first step."""
    return all(os.path.exists(os.path.join(folder, f"ready{r}")) for r in range(ranks))


class Turns:
    """One rank's side of the alternation."""

    def __init__(self, folder: str, first: bool, rank: int) -> None:
        self.folder, self.first, self.rank = folder, first, rank
        self.waited = 0.0  # seconds blocked, waiting for the turn
        self.cpu_while_waiting = 0.0  # CPU seconds this process used meanwhile
        self._out = self._in = -1
        self._gone = False  # the other program has ended: no more waiting

    def _open(self) -> None:
        # Both open `a` first, then `b`, so the two blocking opens pair up without a deadlock.
        a, b = (os.path.join(self.folder, f"{x}{self.rank}") for x in "ab")
        if self.first:
            self._out, self._in = os.open(a, os.O_WRONLY), os.open(b, os.O_RDONLY)
        else:
            self._in, self._out = os.open(a, os.O_RDONLY), os.open(b, os.O_WRONLY)

    def start(self) -> None:
        """The second program, before anything else: wait for the first's first step."""
        self._exchange(send=False)

    def handover(self) -> None:
        """At the end of a step: give the turn to the other program, wait for it back."""
        self._exchange(send=True)

    def _exchange(self, send: bool) -> None:
        if self._gone:
            return
        began, cpu = time.perf_counter(), time.process_time()
        try:
            if self._out < 0:  # the first exchange; the first program's opens wait for the
                if self.first:  # second to start up, and that is waiting too
                    open(os.path.join(self.folder, f"ready{self.rank}"), "w").close()
                self._open()
            if send:
                os.write(self._out, b"t")
            self._gone = os.read(self._in, 1) == b""
        except BrokenPipeError:
            self._gone = True
        self.waited += time.perf_counter() - began
        self.cpu_while_waiting += time.process_time() - cpu
