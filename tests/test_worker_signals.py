"""A stop signal passed on by launch.run reaches a worker only once the worker can handle it:
never into its interpreter's start (Python's own trace and status 1, read as a crash)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest

from launch import worker_signals
from launch.run import Group
from tests.helpers import wait_until_handling

pytestmark = pytest.mark.skipif(not os.path.exists("/proc/self/status"), reason="needs /proc")

# A worker whose start takes a second before its handlers are in place, as a loaded machine's
# `site` imports do: a Ctrl-C there is Python's KeyboardInterrupt trace and status 1.
SLOW_START = (
    "import signal, sys, time\n"
    "time.sleep(1.0)\n"
    "def stop(number, frame):\n"
    "    sys.stderr.write('interrupted: one line\\n'); sys.stderr.flush(); sys.exit(130)\n"
    "signal.signal(signal.SIGTERM, stop)\n"
    "signal.signal(signal.SIGINT, stop)\n"
    "time.sleep(60)\n")


def _worker(code: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", code], stderr=subprocess.PIPE, text=True,
                            start_new_session=True)  # a process group of its own, as torchrun's


class _Agent:
    def __init__(self, pids: dict) -> None:
        self._pcontext = self
        self._pids = pids

    def pids(self) -> dict:
        return self._pids


def test_ctrl_c_while_a_worker_starts_waits_for_its_handler() -> None:
    worker = _worker(SLOW_START)
    group = Group()
    group.agent = _Agent({0: worker.pid})
    assert not worker_signals.started(worker.pid)
    group.on_signal(signal.SIGINT, None)
    _, err = worker.communicate(timeout=60)
    assert worker.returncode == 130 and "Traceback" not in err, err
    assert err.strip() == "interrupted: one line"
    assert group.stopping == signal.SIGINT


def test_sent_at_once_the_worker_shows_the_trace_this_avoids() -> None:
    """The fault itself: the same worker given Ctrl-C at once (as launch.run did)."""
    worker = _worker(SLOW_START)
    time.sleep(0.3)
    worker_signals.send([worker.pid], signal.SIGINT)
    _, err = worker.communicate(timeout=60)
    # Status 1 in `site` (a fatal error), -2 after it (KeyboardInterrupt re-raised): a trace.
    assert worker.returncode != 130 and "KeyboardInterrupt" in err, err


def test_a_worker_that_never_handles_sigterm_still_gets_it(monkeypatch) -> None:
    monkeypatch.setattr(worker_signals, "STARTING_S", 0.5)
    worker = _worker("import time\ntime.sleep(60)\n")
    began = time.monotonic()
    worker_signals.send_once_started([worker.pid], signal.SIGTERM)
    worker.wait(timeout=30)
    assert worker.returncode == -signal.SIGTERM
    assert 0.4 <= time.monotonic() - began < 5, time.monotonic() - began


def test_a_worker_handling_sigterm_counts_as_started_and_its_age_is_read() -> None:
    worker = _worker("import signal, time\nsignal.signal(signal.SIGTERM, lambda *a: None)\n"
                     "print(flush=True)\ntime.sleep(60)\n")
    try:
        wait_until_handling(worker.pid, 30)
        assert worker_signals.handles_sigterm(worker.pid)
        assert worker_signals.started(worker.pid)
        age = worker_signals.age_s(worker.pid)
        assert age is not None and 0 <= age < 30, age
    finally:
        worker.kill()
        worker.wait()
    assert worker_signals.started(worker.pid)  # an ended worker takes anything
