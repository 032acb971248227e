"""CUDA-marked tests run only where a CUDA device is visible; fixtures shared by several modules."""

from __future__ import annotations

import pytest


def pytest_collection_modifyitems(config, items):
    import torch

    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device (none visible)")
    for item in items:
        if "cuda" in item.keywords:
            item.add_marker(skip)


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
