"""The processes a test leaves behind: a test that fails between starting a run (a trainer,
torchrun and its ranks, launch.run) and waiting for it leaves the run going, and two such runs
once took ~85% of a core for the next 27 minutes of the suite (BENCHMARKS, whole test suite).
tests/conftest.py ends them after a failed test."""

from __future__ import annotations

import os
import signal

from trainer.state.rundir import stat_fields


def children_by_parent() -> dict[int, list[int]]:
    """Every process's children, read from /proc/<pid>/stat's ppid field."""
    tree: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            ppid = int(stat_fields(int(entry))[1])
        except (OSError, IndexError, ValueError):
            continue  # gone since listdir, or not readable
        tree.setdefault(ppid, []).append(int(entry))
    return tree


def descendants(pid: int, tree: dict[int, list[int]] | None = None) -> list[int]:
    """pid's children, their children and so on, each before its parent."""
    tree = children_by_parent() if tree is None else tree
    found = []
    for child in tree.get(pid, []):
        found += descendants(child, tree) + [child]
    return found


def kill_tree(pid: int) -> list[int]:
    """SIGKILL pid and everything under it, the deepest first (a torchrun agent killed first
    would leave its ranks to init); returns the pids signalled."""
    signalled = []
    for target in descendants(pid) + [pid]:
        try:
            os.kill(target, signal.SIGKILL)
            signalled.append(target)
        except ProcessLookupError:
            pass
    return signalled
