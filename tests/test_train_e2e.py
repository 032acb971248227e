"""The trainer as a user runs it: learning, run directories, metrics, W&B, rank-0-only outputs."""

from __future__ import annotations

import json

import pytest

from tests.helpers import QUICK, check_ok, read_metrics, read_wandb_records, run_trainer
from trainer.state.rundir import run_id

METRIC_KEYS = {"step", "loss", "lr", "grad_norm", "tokens_per_s", "step_time_s", "samples_per_s",
               "data_wait_s", "peak_mem_bytes", "tokens_seen"}


@pytest.mark.slow
def test_default_tiny_model_learns(tmp_path) -> None:
    """The default job (tiny model, stdlib bytes), cut short: val loss falls by over 40%."""
    run_dir = tmp_path / "run"
    check_ok(run_trainer(["train.steps=40", "train.eval_every=40", "train.eval_at_start=true",
                          "logging.wandb=false",
                          f"hydra.run.dir={run_dir}"], cwd=tmp_path, timeout=600))
    val = [m["val_loss"] for m in read_metrics(run_dir) if "val_loss" in m]
    assert len(val) == 2
    assert val[1] < 0.6 * val[0], val


@pytest.mark.slow
def test_two_ranks_share_one_run_dir_and_only_rank0_writes(tmp_path) -> None:
    result = run_trainer(QUICK + ["train.steps=6", "logging.every=2", "logging.wandb=true",
                                  "train.eval_at_start=true", "train.out_dir=out"],
                         cwd=tmp_path, nproc=2)
    check_ok(result)
    run_dirs = list((tmp_path / "out").iterdir())
    assert len(run_dirs) == 1, run_dirs  # both ranks resolved the same directory
    run_dir = run_dirs[0]
    # No --rdzv-id: named after the torchrun agent, which both workers share.
    assert run_dir.name.startswith("run-")
    assert sorted(p.name for p in run_dir.iterdir()) == sorted(
        [".hydra", ".lock", "checkpoints", "memory_plan.json", "memory_plan.png", "metrics.jsonl",
         "plan.json", "train.log", "wandb", "wandb_run_id", "wandb_step"])
    # Config dump and log once, from rank 0: nothing written anywhere else.
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]

    metrics = read_metrics(run_dir)
    logged = [m for m in metrics if "loss" in m]
    assert [m["step"] for m in logged] == [2, 4, 6]
    assert all(METRIC_KEYS <= m.keys() for m in logged)
    assert all(m["peak_mem_bytes"] > 0 and m["tokens_per_s"] > 0 for m in logged)
    assert all(isinstance(m["loss"], float) for m in logged)
    plan = json.loads((run_dir / "plan.json").read_text())
    assert [p["name"] for p in plan] == [f"layers.{i}" for i in range(4)] + ["head"]
    assert plan[-1] == {"name": "head", "head": "plain", "chunk_tokens": None}
    assert all(p["shard"] and p["recompute"] == "none" for p in plan[:-1])

    # W&B: exactly one offline run (rank 0's), holding the same history as metrics.jsonl.
    runs = list((run_dir / "wandb").glob("offline-run-*/run-*.wandb"))
    assert len(runs) == 1, runs
    wandb_id = (run_dir / "wandb_run_id").read_text().strip()
    assert runs[0].name == f"run-{wandb_id}.wandb"
    history = {}
    for record in read_wandb_records(runs[0]):
        if record.WhichOneof("record_type") == "history":
            row = {(item.key or "/".join(item.nested_key)): json.loads(item.value_json)
                   for item in record.history.item}
            history[row["_step"]] = row
    for m in logged:
        assert history[m["step"]]["loss"] == m["loss"]
        assert history[m["step"]]["grad_norm"] == m["grad_norm"]
    assert "val_loss" in history[0]


def test_run_id_is_shared_by_ranks_and_restarts() -> None:
    assert run_id("my run/1", {}) == "my-run-1"
    assert run_id(None, {"SLURM_JOB_ID": "42", "TORCHELASTIC_RUN_ID": "x"}) == "slurm-42"
    assert run_id(None, {"TORCHELASTIC_RUN_ID": "abc"}) == "torchrun-abc"
    # torchrun without --rdzv-id: named after the agent process, identical for all its workers.
    first = run_id(None, {"TORCHELASTIC_RUN_ID": "none"})
    assert first.startswith("run-") and first == run_id(None, {"TORCHELASTIC_RUN_ID": "none"})
    assert run_id(None, {}) != first  # a plain process is named after itself
