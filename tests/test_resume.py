"""Resumable runs end to end through the CLI: stop and resume bit for bit, preemption signals, a
worker killed under torchrun, damaged checkpoints, reshard on resume, NaN and spike handling."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.helpers import (QUICK, REPO, check_ok, free_port, read_metrics, run_trainer,
                           step_losses, subprocess_env)

STEPS = 8
# Dropout on and a recompute policy: the RNG state must come back exactly for bitwise losses.
BASE = [*QUICK, f"train.steps={STEPS}", "save.every=2", "model.dropout=0.1",
        "checkpointing=full", "train.eval_every=4"]
PREEMPTED = 75


def val_losses(run_dir: Path) -> dict[int, float]:
    return {m["step"]: m["val_loss"] for m in read_metrics(run_dir) if "val_loss" in m}


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory) -> dict[int, Path]:
    """The reference runs, 1 and 2 ranks, computed once."""
    runs = {}
    for nproc in (1, 2):
        run_dir = tmp_path_factory.mktemp(f"full{nproc}")
        check_ok(run_trainer([*BASE, f"hydra.run.dir={run_dir}"], REPO, nproc=nproc))
        runs[nproc] = run_dir
    return runs


@pytest.mark.parametrize("nproc", [1, 2])
def test_stop_then_resume_is_bitwise_identical(tmp_path, uninterrupted, nproc) -> None:
    run = [*BASE, f"hydra.run.dir={tmp_path}"]
    stopped = run_trainer([*run, "train.stop_at_step=4"], REPO, nproc=nproc)
    if nproc == 1:
        assert stopped.returncode == PREEMPTED, stopped.stderr[-3000:]
    assert "stopping (train.stop_at_step): saved step 4" in stopped.stderr + stopped.stdout
    assert max(step_losses(tmp_path)) == 4
    resumed = run_trainer(run, REPO, nproc=nproc)
    check_ok(resumed)
    assert "resumed from" in resumed.stderr + resumed.stdout
    reference = uninterrupted[nproc]
    assert step_losses(tmp_path) == step_losses(reference)  # exact floats, every step
    assert val_losses(tmp_path) == val_losses(reference)
    # Retention: the newest two committed checkpoints, nothing torn or temporary left.
    assert sorted(os.listdir(tmp_path / "checkpoints")) == ["step_00000006", "step_00000008"]


def test_async_save_resumes_identically(tmp_path, uninterrupted) -> None:
    run = [*BASE, f"hydra.run.dir={tmp_path}", "save.async_save=true"]
    assert run_trainer([*run, "train.stop_at_step=5"], REPO).returncode == PREEMPTED
    check_ok(run_trainer(run, REPO))
    assert step_losses(tmp_path) == step_losses(uninterrupted[1])


def _wait_for_step(run_dir: Path, step: int, proc: subprocess.Popen, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if (run_dir / "metrics.jsonl").exists() and max(step_losses(run_dir), default=0) >= step:
            return
        assert proc.poll() is None, proc.communicate()[1][-3000:]
        time.sleep(0.05)
    raise AssertionError(f"step {step} not reached")


def _children(pid: int) -> list[int]:
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    fields = f.read().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if int(fields[1]) == pid:
                found.append(int(entry))
    return sorted(found)


def _torchrun(overrides: list[str], extra: list[str] = ()) -> subprocess.Popen:
    # Restarts need the agent's rendezvous store kept apart from the workers' (pytorch#135712:
    # a restarted group can read the previous attempt's addresses); launch/ sets it too.
    env = subprocess_env({"TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"})
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node=2",
           "--rdzv-backend=c10d", f"--rdzv-endpoint=127.0.0.1:{free_port()}", *extra,
           "-m", "trainer", *overrides]
    return subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)


def test_signal_to_one_rank_stops_all_after_saving(tmp_path, uninterrupted) -> None:
    # Slow steps so the signal lands mid-run; the vote makes rank 0 stop too.
    run = [*BASE, f"hydra.run.dir={tmp_path}", "train.steps=40", "save.every=100"]
    proc = _torchrun(run)
    try:
        _wait_for_step(tmp_path, 2, proc)
        workers = _children(proc.pid)
        assert len(workers) == 2
        os.kill(workers[1], signal.SIGUSR1)
        out, err = proc.communicate(timeout=120)
    finally:
        proc.kill()
    assert "stopping (another rank's signal)" in out + err, err[-3000:]
    stopped_at = max(step_losses(tmp_path))
    assert stopped_at < 40
    assert os.listdir(tmp_path / "checkpoints") == [f"step_{stopped_at:08d}"]


def test_worker_killed_under_torchrun_restarts_and_resumes(tmp_path) -> None:
    run = [*BASE, f"hydra.run.dir={tmp_path / 'killed'}", "train.steps=30", "save.every=3"]
    reference = tmp_path / "reference"
    check_ok(run_trainer([*run[:-3], f"hydra.run.dir={reference}", "train.steps=30",
                          "save.every=3"], REPO, nproc=2))
    proc = _torchrun(run, ["--max-restarts=1"])
    try:
        _wait_for_step(tmp_path / "killed", 7, proc)
        os.kill(_children(proc.pid)[1], signal.SIGKILL)
        out, err = proc.communicate(timeout=240)
    finally:
        proc.kill()
    assert proc.returncode == 0, err[-4000:]
    assert "resumed from" in out + err
    assert step_losses(tmp_path / "killed") == step_losses(reference)
    assert _children(proc.pid) == []  # no stray workers


def test_resume_skips_a_damaged_checkpoint_naming_it(tmp_path, uninterrupted) -> None:
    run = [*BASE, f"hydra.run.dir={tmp_path}", "save.keep=3"]
    assert run_trainer([*run, "train.stop_at_step=6"], REPO).returncode == PREEMPTED
    newest = tmp_path / "checkpoints" / "step_00000006"
    shard = newest / "__0_0.distcp"
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0xFF
    shard.write_bytes(bytes(data))
    resumed = run_trainer(run, REPO)
    check_ok(resumed)
    log = resumed.stderr + resumed.stdout
    assert f"checkpoint {newest} skipped: __0_0.distcp does not match its checksum" in log
    assert "resumed from " + str(tmp_path / "checkpoints" / "step_00000004") in log
    assert step_losses(tmp_path) == step_losses(uninterrupted[1])


def test_saved_on_two_ranks_resumed_on_one(tmp_path) -> None:
    # The same global batch at both sizes (1 rank accumulates 2 micro-batches).
    same = [*QUICK, f"train.steps={STEPS}", "train.global_batch_size=8"]
    run = [*same, "save.every=2", f"hydra.run.dir={tmp_path}"]
    reference = tmp_path.parent / (tmp_path.name + "-ref")
    check_ok(run_trainer([*same, f"hydra.run.dir={reference}"], REPO, nproc=2))
    run_trainer([*run, "train.stop_at_step=4"], REPO, nproc=2)
    resumed = run_trainer(run, REPO, nproc=1)
    check_ok(resumed)
    assert "saved by 2 ranks, resumed on 1" in resumed.stderr + resumed.stdout
    ours, theirs = step_losses(tmp_path), step_losses(reference)
    assert ours.keys() == theirs.keys()
    for step in ours:  # no dropout: 1 and 2 ranks compute the same maths, summed differently
        assert ours[step] == pytest.approx(theirs[step], rel=1e-4), step
    # Issue 47 fault 8: the one rank scores the 16 validation samples the two scored (2 ranks x
    # eval_batches 2 x micro 4), not 8 of its own; 8 of them are another val_loss.
    ours, theirs = val_losses(tmp_path), val_losses(reference)
    assert ours.keys() == theirs.keys() == {5, STEPS}, (ours, theirs)
    for step in ours:
        assert ours[step] == pytest.approx(theirs[step], rel=1e-4), step


def test_the_resume_line_says_the_data_order_once(tmp_path) -> None:
    """Issue 27 item 11: 2 ranks -> 1 without train.global_batch_size halves the global batch;
    the line says the data order differs, and not also that it is unchanged."""
    run = [*QUICK, "train.steps=3", "save.every=1", f"hydra.run.dir={tmp_path}"]
    assert run_trainer([*run, "train.stop_at_step=1"], REPO, nproc=2,
                       launcher="launch.run").returncode == PREEMPTED
    resumed = run_trainer(run, REPO, nproc=1)
    check_ok(resumed)
    line = next(line for line in (resumed.stdout + resumed.stderr).splitlines()
                if "resumed from" in line)
    assert "saved by 2 ranks, resumed on 1: model and optimizer are exact, dropout masks" in line
    assert "global batch 8 x 64 tokens became 4 x 64: the data order from here differs" in line
    assert "unchanged" not in line
    # Issue 47 fault 8: the one rank scores the two ranks' 16 validation samples; nothing to say.
    assert "validation" not in line


def test_nan_step_is_skipped_and_a_spike_rolls_back(tmp_path) -> None:
    run = [*QUICK, "train.steps=16", "save.every=5", "faults.inject_nan_at=[3]",
           "faults.inject_spike_at=[13]", f"hydra.run.dir={tmp_path}"]
    result = run_trainer(run, REPO)
    check_ok(result)
    records = read_metrics(tmp_path)
    skipped = [m for m in records if m.get("skipped_step")]
    assert [m["step"] for m in skipped] == [4, 13]  # batch 3 at step 4; the spike at step 13
    assert "not finite" in skipped[0]["reason"] and "median" in skipped[1]["reason"]
    rollbacks = [m for m in records if "rollback_from_step" in m]
    assert [(m["rollback_from_step"], m["step"]) for m in rollbacks] == [(13, 10)]
    assert "rolled back from step 13 to the checkpoint of step 10" in result.stderr + result.stdout
    losses = step_losses(tmp_path)
    assert sorted(losses) == list(range(1, 17))
    assert all(loss == loss and loss < 10 for loss in losses.values())  # finite, no spike kept


def test_persistent_nan_without_checkpoint_stops_with_the_setting_to_change(tmp_path) -> None:
    run = [*QUICK, "train.steps=8", "save.every=0", "faults.inject_nan_at=[2,3,4]",
           f"hydra.run.dir={tmp_path}"]
    result = run_trainer(run, REPO)
    assert result.returncode != 0
    assert "faults.max_bad_steps: 3 bad steps in a row" in result.stderr


def test_stuck_rank_gives_an_error_naming_rank_and_operation(tmp_path) -> None:
    run = [*QUICK, "train.steps=6", "train.dist_timeout_s=5", "faults.inject_hang_at=[2]",
           f"hydra.run.dir={tmp_path}"]
    started = time.monotonic()
    result = run_trainer(run, REPO, nproc=2, timeout=120)
    assert result.returncode != 0
    assert ("error: rank 0: step 3 (forward, backward, gradient reduction) failed waiting for "
            "the other ranks (timeout train.dist_timeout_s=5)") in result.stderr
    assert time.monotonic() - started < 60
    # ... and rank 0 raised the alert before leaving (trainer/observe/watch.py)
    alerts = [m for m in read_metrics(tmp_path) if m.get("alert") == "collective_timeout"]
    assert len(alerts) == 1 and alerts[0]["step"] == 3 and "rank 0" in alerts[0]["text"]
    assert "ALERT collective_timeout (step 3)" in (tmp_path / "train.log").read_text()


def test_killed_while_saving_resumes_from_the_previous_checkpoint(tmp_path) -> None:
    # A model big enough that writing a checkpoint takes a while, so the kill lands inside it.
    run = [*QUICK, "train.steps=6", "save.every=2", "model.dim=512", "model.ffn_hidden=1536",
           "model.n_heads=8", "model.n_kv_heads=8", f"hydra.run.dir={tmp_path}"]
    reference = tmp_path.parent / (tmp_path.name + "-ref")
    check_ok(run_trainer([*run[:-1], f"hydra.run.dir={reference}"], REPO))
    proc = subprocess.Popen([sys.executable, "-m", "trainer", *run], cwd=REPO,
                            env=subprocess_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    torn = tmp_path / "checkpoints" / "step_00000004"
    try:
        deadline = time.monotonic() + 120
        while not (torn.exists() and not (torn / "COMMITTED.json").exists()):
            assert proc.poll() is None and time.monotonic() < deadline, "no save in progress seen"
            time.sleep(0.002)
        proc.kill()
        proc.wait()
    finally:
        proc.kill()
    assert not (torn / "COMMITTED.json").exists()  # killed before the commit
    resumed = run_trainer(run, REPO)
    check_ok(resumed)
    log = resumed.stderr + resumed.stdout
    assert f"checkpoint {torn} skipped: no COMMITTED.json (the save did not finish)" in log
    assert "resumed from " + str(tmp_path / "checkpoints" / "step_00000002") in log
    assert step_losses(tmp_path) == step_losses(reference)
    assert sorted(os.listdir(tmp_path / "checkpoints")) == ["step_00000004", "step_00000006"]


def _wandb_history(run_dir: Path) -> list[list[tuple[int, dict]]]:
    """Per W&B run file (one per start, in start order): (W&B step, {key: value}) per point."""
    from tests.helpers import read_wandb_records

    starts = []
    for path in sorted((run_dir / "wandb").glob("offline-run-*/run-*.wandb")):
        points = []
        for record in read_wandb_records(path):
            if record.WhichOneof("record_type") == "history":
                items = {i.key or "/".join(i.nested_key): json.loads(i.value_json)
                         for i in record.history.item}
                points.append((record.history.step.num, items))
        starts.append(points)
    return starts


def test_replayed_steps_are_recorded_once_and_shown_by_wandb(tmp_path) -> None:
    """Issue 27 item 10: the newest checkpoint is lost (a failed save, a damaged folder) and
    the run resumes from an earlier one. metrics.jsonl keeps one record per step, the earlier
    records of the replayed steps go to metrics.superseded.jsonl, and W&B gets the replayed
    points after the earlier ones instead of dropping them."""
    run = [*QUICK, "train.steps=6", "save.every=3", "logging.wandb=true",
           "train.eval_at_start=true", f"hydra.run.dir={tmp_path}"]
    check_ok(run_trainer(run, REPO))
    first = step_losses(tmp_path)
    shutil.rmtree(tmp_path / "checkpoints" / "step_00000006")
    resumed = run_trainer(run, REPO)
    check_ok(resumed)
    assert ("metrics.jsonl: the records of steps 4-6, from before this start, were moved to "
            "metrics.superseded.jsonl") in resumed.stdout + resumed.stderr
    records = read_metrics(tmp_path)
    assert [m["step"] for m in records if "loss" in m] == [1, 2, 3, 4, 5, 6]
    assert [m["step"] for m in records if "val_loss" in m] == [0, 5, 6]
    superseded = [json.loads(line) for line in
                  (tmp_path / "metrics.superseded.jsonl").read_text().splitlines()]
    assert [m["step"] for m in superseded if "loss" in m] == [4, 5, 6]
    assert {m["step"]: m["loss"] for m in superseded if "loss" in m} == \
        {s: first[s] for s in (4, 5, 6)} == {s: step_losses(tmp_path)[s] for s in (4, 5, 6)}
    before, after = _wandb_history(tmp_path)
    assert min(step for step, _ in after) > max(step for step, _ in before)
    assert sorted(p["opt_step"] for _, p in after if "loss" in p) == [4, 5, 6]
