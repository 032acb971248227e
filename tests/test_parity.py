"""Sharded and single-process training agree: same global batch, same per-step losses."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.helpers import QUICK, check_ok, losses, read_metrics, run_trainer

STEPS = 10
COMMON = QUICK + [f"train.steps={STEPS}", "model.dropout=0.0"]


@pytest.fixture(scope="module")
def single_process(tmp_path_factory) -> Path:
    run_dir = tmp_path_factory.mktemp("single") / "run"
    # One process, micro batch 4: the same 4 sequences per step as 2 ranks x micro batch 2.
    check_ok(run_trainer(COMMON + [f"hydra.run.dir={run_dir}"], cwd=run_dir.parent))
    assert len(losses(run_dir)) == STEPS
    return run_dir


def _grad_norms(run_dir: Path) -> list[float]:
    return [m["grad_norm"] for m in read_metrics(run_dir) if "grad_norm" in m]


@pytest.mark.slow
@pytest.mark.parametrize("layout", [
    ["sharding=fsdp"],
    ["sharding=hsdp", "sharding.replicate=2"],
    ["sharding=none"],  # DDP
    ["sharding=hsdp", "sharding.replicate=2", "train.grad_accum=2"],
    ["sharding=fsdp", "train.grad_accum=2"],
    ["sharding=none", "train.grad_accum=2"],
], ids=["fsdp", "hsdp", "ddp", "hsdp-accum", "fsdp-accum", "ddp-accum"])
def test_two_ranks_match_one_process(layout, single_process, tmp_path) -> None:
    run_dir = tmp_path / "run"
    micro = 1 if "train.grad_accum=2" in layout else 2  # 4 sequences per step in all cases
    result = run_trainer(COMMON + layout + [f"train.micro_batch_size={micro}",
                                            f"hydra.run.dir={run_dir}"], cwd=tmp_path, nproc=2)
    check_ok(result)
    two_rank = losses(run_dir)
    assert len(two_rank) == STEPS
    assert two_rank == pytest.approx(losses(single_process), rel=1e-4)
    # Clipping sees the norm of the whole model, not of a rank's shard.
    assert _grad_norms(run_dir) == pytest.approx(_grad_norms(single_process), rel=1e-4)
    # The losses move: agreeing on a constant would prove nothing.
    assert two_rank[-1] < two_rank[0] - 0.5


@pytest.mark.slow
def test_grad_accumulation_matches_a_bigger_micro_batch(single_process, tmp_path) -> None:
    run_dir = tmp_path / "run"
    check_ok(run_trainer(COMMON + ["train.micro_batch_size=1", "train.grad_accum=4",
                                   f"hydra.run.dir={run_dir}"], cwd=tmp_path))
    assert losses(run_dir) == pytest.approx(losses(single_process), rel=1e-4)
    logged = [m for m in read_metrics(run_dir) if "loss" in m]
    assert all(m["tokens_seen"] == m["step"] * 4 * 64 for m in logged)
