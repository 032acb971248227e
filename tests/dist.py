"""Our own small multi-process test helper (torch's distributed test base classes are private).

`spawn(fn, world_size, *args)` runs `fn(rank, world_size, *args)` in fresh processes joined in a
gloo process group, and returns each rank's return value; a failure on any rank fails the test
with that rank's traceback.
"""

from __future__ import annotations

import io
import os
import tempfile
import traceback
from typing import Any, Callable

import torch.multiprocessing as mp


def _entry(rank: int, world_size: int, store_path: str, fn: Callable, args: tuple,
           results: Any) -> None:
    import faulthandler

    import torch
    import torch.distributed as dist

    # A native crash (a C library's abort, a segfault) names where each thread was: the
    # traceback put on the queue below is never written by a process that dies that way.
    faulthandler.enable(all_threads=True)
    os.environ.update({"RANK": str(rank), "WORLD_SIZE": str(world_size),
                       "LOCAL_RANK": str(rank), "LOCAL_WORLD_SIZE": str(world_size)})
    torch.set_num_threads(1)
    store = dist.FileStore(store_path, world_size)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world_size)
    try:
        # Tensors are sent as bytes: torch's queue pickling shares memory through handles that die
        # with this process before the parent reads them.
        from tests.checkpoint_harness import fixed_planner_timings

        buffer = io.BytesIO()
        with fixed_planner_timings():  # as in the test's own process (tests/conftest.py)
            torch.save(fn(rank, world_size, *args), buffer)
        results.put((rank, "ok", buffer.getvalue()))
    except BaseException:
        results.put((rank, "error", traceback.format_exc()))
        raise
    finally:
        dist.destroy_process_group()


def _next_result(results, procs, limit_s: float = 3600.0):
    """The next rank's result, waited for as long as a rank is alive to send one: a fixed wait
    failed the test on a loaded machine while the ranks were still working."""
    import queue
    import time

    deadline = time.monotonic() + limit_s
    while True:
        try:
            return results.get(timeout=5)
        except queue.Empty:
            # A rank that ended (killed, or failed past its report) sends nothing more: one more
            # look, as it may have just sent.
            if any(p.exitcode not in (None, 0) for p in procs) or \
                    not any(p.is_alive() for p in procs):
                try:
                    return results.get(timeout=5)
                except queue.Empty:
                    codes = [p.exitcode for p in procs]
                    raise AssertionError(f"ranks ended without a result (exit codes {codes})")
            if time.monotonic() > deadline:
                raise AssertionError(f"no result from the ranks in {limit_s:.0f} s")


def spawn(fn: Callable, world_size: int, *args: Any) -> list[Any]:
    """fn must be a module-level function (it is pickled into the workers)."""
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    with tempfile.TemporaryDirectory() as tmp:
        store_path = os.path.join(tmp, "store")
        procs = [ctx.Process(target=_entry, args=(rank, world_size, store_path, fn, args, results))
                 for rank in range(world_size)]
        for p in procs:
            p.start()
        outcomes = {}
        for _ in range(world_size):
            try:
                rank, status, value = _next_result(results, procs)
            except AssertionError:
                for p in procs:
                    p.kill()
                raise
            outcomes[rank] = (status, value)
            if status == "error":
                for p in procs:
                    p.kill()
                raise AssertionError(f"rank {rank} failed:\n{value}")
        for p in procs:
            p.join(60)
    import torch

    return [torch.load(io.BytesIO(outcomes[rank][1]), weights_only=True)
            for rank in range(world_size)]
