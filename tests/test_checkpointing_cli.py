"""Checkpoint policies through the trainer CLI: same losses, measured bytes, the budget honoured."""

from __future__ import annotations

import json

import pytest

from checkpointing.plan import block_rows
from tests.helpers import QUICK, check_ok, losses, read_metrics, run_trainer

COMMON = QUICK + ["train.steps=4", "model.dropout=0.1", "checkpointing.profile_repeats=1"]
POLICIES = ["none", "full", "every_k", "sqrt", "selective", "budget"]


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict:
    """Each policy once with 2 ranks (FSDP) and once with 1, four steps, dropout on: one `-m`
    sweep per rank count (the jobs of a sweep share one process, and its start-up)."""
    out = {}
    for nproc in (1, 2):
        out_dir = tmp_path_factory.mktemp(f"sweep{nproc}")
        result = run_trainer(["-m", f"checkpointing={','.join(POLICIES)}", *COMMON,
                              f"train.micro_batch_size={4 // nproc}", f"train.out_dir={out_dir}",
                              "train.run_name=policies"], cwd=out_dir, nproc=nproc)
        check_ok(result)
        for i, policy in enumerate(POLICIES):  # Hydra numbers the jobs in sweep order
            out[policy, nproc] = out_dir / "multirun" / "policies" / str(i)
            assert f"checkpointing={policy}" in (out[policy, nproc] / ".hydra" /
                                                 "overrides.yaml").read_text()
    return out


@pytest.mark.slow
@pytest.mark.parametrize("nproc", [1, 2])
def test_losses_identical_for_every_policy(runs, nproc) -> None:
    reference = losses(runs["none", nproc])
    assert len(reference) == 4
    for policy in POLICIES[1:]:
        assert losses(runs[policy, nproc]) == reference, policy  # bitwise: exact floats


@pytest.mark.slow
def test_measured_activation_bytes_follow_the_plan(runs) -> None:
    saved = {p: read_metrics(runs[p, 1])[1]["act_saved_bytes"] for p in POLICIES}
    assert saved["none"] > saved["selective"] > saved["full"] > 0
    assert saved["none"] > saved["every_k"] > saved["full"]
    plan = block_rows(json.loads((runs["budget", 2] / "plan.json").read_text()))
    assert len(plan) == 4 and {p["recompute"] for p in plan} <= {"none", "selective", "full"}
    # The default budget (half of the no-checkpoint bytes) is honoured by the measurement.
    assert saved["budget"] <= 0.5 * saved["none"]
    # Profiled seconds come with the plans made from timings; the fixed policies are not timed
    # unless checkpointing.profile=true (they start without the timing runs).
    logged = [m for m in read_metrics(runs["budget", 1]) if "loss" in m]
    assert all(m["recompute_s"] > 0 for m in logged)
    assert all("recompute_s" not in m for m in read_metrics(runs["full", 1]))


@pytest.mark.slow
def test_byte_budget_is_never_exceeded(tmp_path) -> None:
    budget = 6_000_000  # between the smallest feasible (~5.0e6) and no checkpointing (~1.6e7)
    run_dir = tmp_path / "run"
    check_ok(run_trainer(COMMON + ["checkpointing=budget", f"checkpointing.budget={budget}",
                                   f"hydra.run.dir={run_dir}"], cwd=tmp_path))
    logged = [m for m in read_metrics(run_dir) if "loss" in m]
    assert logged and all(0 < m["act_saved_bytes"] <= budget for m in logged)


@pytest.mark.slow
def test_infeasible_budget_names_the_smallest_feasible_one(tmp_path) -> None:
    result = run_trainer(COMMON + ["checkpointing=budget", "checkpointing.budget=1000",
                                   f"hydra.run.dir={tmp_path / 'run'}"], cwd=tmp_path)
    assert result.returncode == 2
    lines = [line for line in result.stderr.splitlines() if line.startswith("error: ")]
    assert len(lines) == 1 and "Traceback" not in result.stderr
    assert lines[0].startswith("error: checkpointing.budget: 1000 bytes")
    assert "smallest feasible budget is" in lines[0]


@pytest.mark.slow
def test_compiled_blocks_train_like_eager(tmp_path) -> None:
    """train.compile=true (inductor) against eager, no checkpointing, over several steps."""
    base = QUICK + ["train.steps=6", "model.dropout=0.0"]
    eager, compiled = tmp_path / "eager", tmp_path / "compiled"
    check_ok(run_trainer(base + [f"hydra.run.dir={eager}"], cwd=tmp_path))
    result = run_trainer(base + ["train.compile=true", f"hydra.run.dir={compiled}"], cwd=tmp_path,
                         timeout=600)
    check_ok(result)
    # Inductor fuses kernels (other summation orders), so the floats differ in the last bits
    # and the difference grows a little with each optimizer step; the maths may not differ.
    assert len(losses(compiled)) == 6
    assert losses(compiled) == pytest.approx(losses(eager), rel=1e-4)
    log = (compiled / "train.log").read_text()
    assert "torch.compile: 4 blocks, " in log
