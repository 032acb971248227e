"""tests/processes.py and the hook in tests/conftest.py that ends a failed test's processes."""

from __future__ import annotations

import subprocess
import sys
import time
import types

from tests import conftest
from tests.processes import descendants, kill_tree
from trainer.state.rundir import stat_fields

# A parent (a torchrun agent's part) with two children of its own (its ranks).
TREE = ("import subprocess, sys, time\n"
        "kids = [subprocess.Popen(['sleep', '120']) for _ in range(2)]\n"
        "print(' '.join(str(k.pid) for k in kids), flush=True)\n"
        "time.sleep(120)\n")


def _start_tree() -> tuple[subprocess.Popen, list[int]]:
    parent = subprocess.Popen([sys.executable, "-c", TREE], stdout=subprocess.PIPE, text=True)
    kids = [int(pid) for pid in parent.stdout.readline().split()]
    return parent, kids


def _alive(pid: int) -> bool:
    try:
        return stat_fields(pid)[0] != "Z"  # a zombie has ended
    except OSError:
        return False


def _gone(pids: list[int], timeout: float = 10) -> bool:
    deadline = time.monotonic() + timeout
    while any(_alive(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.05)
    return not any(_alive(p) for p in pids)


def test_kill_tree_ends_a_process_and_its_children() -> None:
    parent, kids = _start_tree()
    try:
        assert sorted(descendants(parent.pid)) == sorted(kids)
        assert sorted(kill_tree(parent.pid)) == sorted(kids + [parent.pid])
        assert _gone(kids) and parent.wait(timeout=10) is not None
    finally:
        for pid in kids:
            subprocess.run(["kill", "-9", str(pid)], capture_output=True)


def test_a_failed_tests_processes_end_with_it_and_a_passed_ones_are_left() -> None:
    """The hook: processes started during a failed test's call are killed, with their children;
    those that were there before (a fixture's) and those of a passing test are left alone."""
    fixture_process, fixture_kids = _start_tree()
    started = []
    try:
        for failed in (True, False):
            hook = conftest.pytest_runtest_call(item=None)
            next(hook)
            parent, kids = _start_tree()  # the test's own run
            started += [parent.pid, *kids]
            excinfo = (AssertionError, AssertionError("failed"), None) if failed else None
            try:
                hook.send(types.SimpleNamespace(excinfo=excinfo))
            except StopIteration:
                pass
            if failed:
                assert _gone(kids) and parent.wait(timeout=10) is not None
            else:
                assert all(_alive(p) for p in [parent.pid, *kids])
                kill_tree(parent.pid)
                parent.wait(timeout=10)
        assert all(_alive(p) for p in [fixture_process.pid, *fixture_kids])
    finally:
        kill_tree(fixture_process.pid)
        fixture_process.wait(timeout=10)
        for pid in started:
            subprocess.run(["kill", "-9", str(pid)], capture_output=True)
