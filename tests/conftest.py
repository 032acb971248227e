"""CUDA-marked tests run only where a CUDA device is visible; every test starts from the same
torch state, whatever ran before it; fixtures shared by several modules."""

from __future__ import annotations

import sys

import pytest


def pytest_configure(config):
    """The tests that press Ctrl-C (SIGINT to a trainer or launch.run) need it to reach them. A
    suite started as a background job of a shell without job control inherits SIGINT ignored,
    and every process it starts would too (an ignored signal stays ignored across exec): those
    tests then saw runs that never heard the Ctrl-C. A handler here does not cross exec, so the
    processes the tests start get the default action, as from a terminal."""
    import signal

    if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
        signal.signal(signal.SIGINT, signal.default_int_handler)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_call(item):
    """A failed test's processes (a run it started and would have waited for) are ended with
    it, so they do not load the rest of the suite (tests/processes.py). Only those started in
    the test itself: a fixture's (a module's shared 2-rank group) outlive it on purpose."""
    import os

    from tests.processes import children_by_parent, kill_tree

    before = set(children_by_parent().get(os.getpid(), []))
    outcome = yield
    if outcome.excinfo is not None:
        for pid in set(children_by_parent().get(os.getpid(), [])) - before:
            kill_tree(pid)


def pytest_collection_modifyitems(config, items):
    import torch

    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device (none visible)")
    for item in items:
        if "cuda" in item.keywords:
            item.add_marker(skip)


def pytest_terminal_summary(terminalreporter, config):
    """The random order's seed, also under -q (which hides pytest-randomly's header line)."""
    seed = getattr(config.option, "randomly_seed", None)
    if isinstance(seed, int) and config.pluginmanager.has_plugin("randomly"):
        terminalreporter.write_line(f"random order: --randomly-seed={seed} repeats it; "
                                    "-p no:randomly keeps the files' order")


@pytest.fixture(scope="session")
def launch_reference(tmp_path_factory):
    """The launcher tests' run under one torchrun agent with 2 processes; computed once."""
    from tests.helpers import LAUNCH_RUN, REPO, check_ok, run_trainer

    run_dir = tmp_path_factory.mktemp("launch-reference")
    check_ok(run_trainer([*LAUNCH_RUN, f"hydra.run.dir={run_dir}"], REPO, nproc=2))
    return run_dir


@pytest.fixture
def world_of_one(monkeypatch):
    """An in-process gloo group of one rank (no torchrun environment), torn down after."""
    from trainer.distenv import init_distributed, read_env, shutdown

    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR"):
        monkeypatch.delenv(key, raising=False)
    init_distributed(read_env("cpu"), timeout_s=60)
    yield
    shutdown()


def _torch_state() -> dict:
    import torch

    return {"dtype": torch.get_default_dtype(), "grad": torch.is_grad_enabled(),
            "deterministic": (torch.are_deterministic_algorithms_enabled(),
                              torch.is_deterministic_algorithms_warn_only_enabled()),
            "threads": torch.get_num_threads(),
            "matmul_precision": torch.get_float32_matmul_precision()}


def _set_torch_state(state: dict) -> None:
    import torch

    torch.set_default_dtype(state["dtype"])
    torch.set_grad_enabled(state["grad"])
    enabled, warn_only = state["deterministic"]
    torch.use_deterministic_algorithms(enabled, warn_only=warn_only)
    torch.set_num_threads(state["threads"])
    torch.set_float32_matmul_precision(state["matmul_precision"])


@pytest.fixture(autouse=True)
def planner_timings_given():
    """The planner's choices in this process are made from given timings, not measured ones
    (tests/checkpoint_harness.py): a loaded machine must not change which plan a test checks.
    Runs of the trainer CLI (subprocesses) still measure; tests.dist.spawn's ranks are given
    them too."""
    from tests.checkpoint_harness import fixed_planner_timings

    with fixed_planner_timings():
        yield


@pytest.fixture(autouse=True)
def independent_of_order():
    """What torch keeps between calls is put back after each test, so that a test's outcome does
    not depend on which ran before it (random order: pytest-randomly): dynamo's compiled graphs
    and recompile counts (per code object, limited to 8 each: graphs cached by earlier tests
    once made later ones fall back to eager and fail), the default dtype, grad mode, the
    deterministic-algorithms flags, the thread count and matmul precision; each test starts
    from the same random seed."""
    import torch

    state = _torch_state()
    torch.manual_seed(0)
    yield
    if "torch._dynamo" in sys.modules:
        torch._dynamo.reset()
    _set_torch_state(state)
