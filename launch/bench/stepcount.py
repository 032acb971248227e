"""Counting what one training step does, without a clock: any training script, per step.

    python -m launch.bench.stepcount [--times [--turns FOLDER:first|second]] OUT_DIR MODULE
        [args ...]   (also under torchrun)

runs `python -m MODULE args` and writes OUT_DIR/rank<r>.json. With `--times`, nothing but the
clock at the end of every optimizer step (a global optimizer post-hook: the same one call for
any script), the wall-clock time of the first one, and the process's peak memory. Otherwise,
for each interval between two optimizer steps, the counts of
- `ops`: aten (and c10d) operators dispatched on the main thread, seen by a TorchDispatchMode;
- `hooks`: calls of hooks registered after start-up: module forward/backward hooks,
  saved-tensor pack/unpack hooks, tensor gradient hooks and autograd engine callbacks;
- `syncs`: reads of tensor values by the host (`_local_scalar_dense`: item(), bool();
  `tolist()`; `torch.cuda.synchronize`), each a host-device synchronisation on a GPU;
- `calls`: Python function calls by file and name (sys.setprofile), but not this module's own
  nor the operator calls its dispatch mode makes.
Timing is meaningless under it: the bench times other runs.
"""

from __future__ import annotations

import atexit
import collections
import json
import os
import resource
import runpy
import sys
import time
from typing import Callable

import torch
from torch.optim.optimizer import register_optimizer_step_post_hook
from torch.utils._python_dispatch import TorchDispatchMode

from launch.bench.turns import Turns

HERE = os.path.abspath(__file__)
ROOT = os.path.dirname(os.path.dirname(HERE)) + os.sep  # the repository (the reference too)


class Counts:
    """The counters of the current interval, and the finished intervals."""

    def __init__(self) -> None:
        self.intervals: list[dict] = []
        self.current: dict[str, collections.Counter] | None = None  # None: before step 1

    def bump(self, kind: str, name: str) -> None:
        if self.current is not None:
            self.current[kind][name] += 1

    def boundary(self) -> None:
        if self.current is not None:
            self.intervals.append({k: dict(v) for k, v in self.current.items()})
        else:  # from the first step on: start-up would cost minutes under the profiler
            sys.setprofile(_profile)
        self.current = {k: collections.Counter() for k in ("ops", "hooks", "syncs", "calls")}


COUNTS = Counts()


def site() -> str:
    """The innermost caller in the repository's own files (the model's, the loop's, the
    reference's), "path:function"; "torch" when torch itself started it (e.g. autograd)."""
    frame = sys._getframe(2)
    while frame is not None:
        name = frame.f_code.co_filename
        if name.startswith(ROOT) and name != HERE and f"{os.sep}.venv" not in name:
            return f"{name[len(ROOT):]}:{frame.f_code.co_name}"
        frame = frame.f_back
    return "torch"


class _CountOps(TorchDispatchMode):
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if COUNTS.current is not None:
            name, where = str(func), site()
            COUNTS.bump("ops", f"{name} @ {where}")
            if name == "aten._local_scalar_dense.default":
                COUNTS.bump("syncs", f"item @ {where}")
        return func(*args, **(kwargs or {}))


_DISPATCH_CODE = _CountOps.__torch_dispatch__.__code__


def _profile(frame, event, arg) -> None:
    if event != "call" or COUNTS.current is None:
        return
    code = frame.f_code
    if code.co_filename == HERE or (frame.f_back is not None
                                    and frame.f_back.f_code is _DISPATCH_CODE):
        return  # ours, or the operator call our dispatch mode makes
    COUNTS.current["calls"][f"{code.co_filename}:{code.co_name}"] += 1


def _counted(kind: str, fn: Callable) -> Callable:
    if not callable(fn):
        return fn
    owner = getattr(fn, "__func__", fn)
    name = f"{kind}: {getattr(owner, '__module__', '?')}.{getattr(owner, '__qualname__', '?')}"

    def hook(*args, **kwargs):
        COUNTS.bump("hooks", name)
        return fn(*args, **kwargs)
    return hook


def _wrap_registration(owner, name: str, kind: str, position: int = 0) -> None:
    """owner.name(hook, ...) registers `hook`: register a counting wrapper of it instead."""
    original = getattr(owner, name)

    def register(self, *args, **kwargs):
        args = list(args)
        if len(args) > position:
            args[position] = _counted(kind, args[position])
        elif "hook" in kwargs:
            kwargs["hook"] = _counted(kind, kwargs["hook"])
        return original(self, *args, **kwargs)
    setattr(owner, name, register)


class _Engine:
    """The autograd engine with its end-of-backward callbacks counted (FSDP queues one)."""

    def __init__(self, engine) -> None:
        self._engine = engine

    def queue_callback(self, callback):
        return self._engine.queue_callback(_counted("engine callback", callback))

    def __getattr__(self, name):
        return getattr(self._engine, name)


def install() -> None:
    """Counters in place before the script builds anything; counting starts at the first
    optimizer step."""
    nn = torch.nn.Module
    for name in ("register_forward_pre_hook", "register_forward_hook",
                 "register_full_backward_pre_hook", "register_full_backward_hook"):
        _wrap_registration(nn, name, "module " + name[len("register_"):])
    _wrap_registration(torch.Tensor, "register_hook", "tensor grad hook")
    _wrap_registration(torch.Tensor, "register_post_accumulate_grad_hook", "tensor grad hook")
    graph = torch.autograd.graph.saved_tensors_hooks
    init = graph.__init__

    def saved_init(self, pack, unpack):
        init(self, _counted("saved-tensor pack", pack), _counted("saved-tensor unpack", unpack))
    graph.__init__ = saved_init
    torch.autograd.Variable._execution_engine = _Engine(torch.autograd.Variable._execution_engine)
    tolist = torch.Tensor.tolist

    def counted_tolist(self):
        COUNTS.bump("syncs", f"tolist @ {site()}")
        return tolist(self)
    torch.Tensor.tolist = counted_tolist
    if torch.cuda.is_available():
        synchronize = torch.cuda.synchronize

        def counted_synchronize(*args, **kwargs):
            COUNTS.bump("syncs", f"cuda.synchronize @ {site()}")
            return synchronize(*args, **kwargs)
        torch.cuda.synchronize = counted_synchronize
    register_optimizer_step_post_hook(lambda *_: COUNTS.boundary())


class Times:
    """The clock at each optimizer step's end; time.time() at the first (start-up ends); the
    memory peak reached by the last step's end (training's peak: what runs after the last step,
    a final save or evaluation that a plain loop may not have, is not in it). With `turns`, the
    turn is handed over after each reading and the seconds waited for it are off the clock."""

    def __init__(self, turns: Turns | None = None) -> None:
        self.turns = turns
        self.step_ends: list[float] = []  # perf_counter, less the seconds waited for turns
        self.step_ends_unix: list[float] = []  # time.time(), waits included
        self.first_step_unix: float | None = None
        self.peak_rss_bytes = 0
        self.max_allocated: int | None = None
        self.minflt: list[int] = []

    def __call__(self, *_) -> None:
        waited = self.turns.waited if self.turns else 0.0
        self.step_ends.append(time.perf_counter() - waited)
        self.step_ends_unix.append(time.time())
        if self.first_step_unix is None:
            self.first_step_unix = time.time() - waited
        # Both only read counters: no synchronisation.
        usage = resource.getrusage(resource.RUSAGE_SELF)
        self.peak_rss_bytes = usage.ru_maxrss * 1024
        self.minflt.append(usage.ru_minflt)
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            self.max_allocated = torch.cuda.max_memory_allocated()
        if self.turns:
            self.turns.handover()

    def result(self) -> dict:
        return {"step_ends": self.step_ends, "first_step_unix": self.first_step_unix,
                "peak_rss_bytes": self.peak_rss_bytes, "max_allocated": self.max_allocated,
                "minflt": self.minflt, "step_ends_unix": self.step_ends_unix,
                "waited_s": self.turns.waited if self.turns else 0.0,
                "cpu_while_waiting_s": self.turns.cpu_while_waiting if self.turns else 0.0}


def _turns(argv: list[str]) -> tuple[Turns | None, list[str]]:
    """`--turns FOLDER:first|second` taken off the front of argv (launch/bench/turns.py)."""
    if argv[0] != "--turns":
        return None, argv
    folder, _, side = argv[1].rpartition(":")
    turns = Turns(folder, side == "first", int(os.environ.get("RANK", "0")))
    if side == "second":
        turns.start()
    return turns, argv[2:]


def main(argv: list[str]) -> None:
    timing = argv[0] == "--times"
    turns, argv = _turns(argv[timing:]) if timing else (None, argv)
    out, module, rest = argv[0], argv[1], argv[2:]
    os.makedirs(out, exist_ok=True)
    times = Times(turns)
    if timing:
        register_optimizer_step_post_hook(times)
    else:
        install()

    def write() -> None:
        sys.setprofile(None)
        rank = int(os.environ.get("RANK", "0"))
        with open(os.path.join(out, f"rank{rank}.json"), "w") as f:
            json.dump(times.result() if timing else COUNTS.intervals, f)
    atexit.register(write)
    sys.argv = [module, *rest]
    if not timing:
        _CountOps().__enter__()
    status = 0
    try:
        runpy.run_module(module, run_name="__main__", alter_sys=True)
    except SystemExit as stop:
        status = stop.code if isinstance(stop.code, int) else int(stop.code is not None)
    finally:
        write()
    # Without the interpreter's teardown, once every figure is written and the exit handlers
    # have run: a 2-rank gloo run once aborted there ("terminate called without an active
    # exception", CI 2026-12-01), which failed a benchmark whose numbers were all in.
    atexit._run_exitfuncs()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(status)


if __name__ == "__main__":
    main(sys.argv[1:])
