"""Multi-node without Slurm: two torchrun agents (`--nnodes 2`, c10d) on this host, as on two
machines; and Hydra `-m` sweeps run locally one job after another."""

from __future__ import annotations

import subprocess
import sys

import pytest

from tests.helpers import (LAUNCH_RUN, QUICK, REPO, check_ok, free_port, read_metrics,
                           step_losses, subprocess_env)

pytestmark = pytest.mark.slow


def test_two_torchrun_agents_match_one_agent(tmp_path, launch_reference) -> None:
    # The README's two-node command, both "nodes" on this host: one rendezvous endpoint and id,
    # each agent starting one worker. No hydra.run.dir: the run id comes from --rdzv-id.
    port = free_port()
    out_dir = tmp_path / "outputs"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes=2", "--nproc-per-node=1",
           "--rdzv-backend=c10d", f"--rdzv-endpoint=127.0.0.1:{port}", "--rdzv-id=two-nodes",
           "-m", "trainer", *LAUNCH_RUN, f"train.out_dir={out_dir}"]
    env = subprocess_env({"TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"})
    agents = [subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE,
                               stderr=subprocess.PIPE, text=True) for _ in range(2)]
    try:
        results = [agent.communicate(timeout=300) for agent in agents]
    finally:
        for agent in agents:
            agent.kill()
    for agent, (out, err) in zip(agents, results):
        assert agent.returncode == 0, err[-4000:]
    assert [p.name for p in out_dir.iterdir()] == ["torchrun-two-nodes"]  # one run directory
    run_dir = out_dir / "torchrun-two-nodes"
    logs = "".join(out + err for out, err in results)
    assert "world 2 (fsdp" in logs
    assert step_losses(run_dir) == step_losses(launch_reference)  # exact, every step
    assert sorted(step_losses(run_dir)) == list(range(1, 25))


def test_multirun_sweep_writes_one_run_directory_per_job(tmp_path) -> None:
    out_dir = tmp_path / "outputs"
    cmd = [sys.executable, "-m", "trainer", "-m", "checkpointing=none,full", *QUICK,
           "train.steps=3", f"train.out_dir={out_dir}", "train.run_name=sweep"]
    result = subprocess.run(cmd, cwd=tmp_path, env=subprocess_env(), capture_output=True,
                            text=True, timeout=300)
    check_ok(result)
    sweep_dir = out_dir / "multirun" / "sweep"
    jobs = sorted(p for p in sweep_dir.iterdir() if p.is_dir())
    assert [p.name for p in jobs] == ["0", "1"]
    for job, policy in zip(jobs, ("none", "full")):
        assert f"checkpointing={policy}" in (job / ".hydra" / "overrides.yaml").read_text()
        assert sorted(step_losses(job)) == [1, 2, 3]
        assert any("val_loss" in m for m in read_metrics(job))
        plan = (job / "plan.json").read_text()
        assert f'"recompute": "{policy}"' in plan


def test_a_bad_job_in_a_sweep_is_refused_before_the_first_starts(tmp_path) -> None:
    cmd = [sys.executable, "-m", "trainer", "-m", "train.steps=2,abc", *QUICK,
           f"train.out_dir={tmp_path}"]
    result = subprocess.run(cmd, cwd=tmp_path, env=subprocess_env(), capture_output=True,
                            text=True, timeout=120)
    assert result.returncode == 2
    assert result.stderr.strip().splitlines() == [
        "error: train.steps: Value 'abc' of type 'str' could not be converted to Integer"]
    assert not (tmp_path / "multirun").exists()  # not even the first job ran
