"""The Slurm launcher on a real 2-node Slurm cluster (tests/slurm_cluster.py): the generated job
trains like torchrun, survives preemption by requeueing, and bad requests never reach sbatch."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.helpers import LAUNCH_RUN, REPO, read_metrics, step_losses, subprocess_env
from tests.slurm_cluster import LocalSlurm, unavailable

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    reason = unavailable()
    if reason:
        pytest.skip(reason)
    test_cluster = LocalSlurm(tmp_path_factory.mktemp("slurm"))
    try:
        test_cluster.start()
        yield test_cluster
    finally:
        test_cluster.stop()


def launch(cluster: LocalSlurm, args: list[str], cwd: Path) -> subprocess.CompletedProcess:
    env = subprocess_env({"SLURM_CONF": str(cluster.conf)})
    return subprocess.run([sys.executable, "-m", "launch.slurm", *args], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=120)


def submitted(result: subprocess.CompletedProcess) -> tuple[str, Path, Path]:
    """(job id, run dir, output file) from the launcher's last line."""
    assert result.returncode == 0, result.stderr[-3000:]
    match = re.search(r"submitted job (\d+): run dir (\S+); output (\S+)", result.stdout)
    assert match, result.stdout
    return match.group(1), Path(match.group(2)), Path(match.group(3))


def wait_until(condition, timeout: float, what: str, interval: float = 0.1):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = condition()
        if value:
            return value
        time.sleep(interval)
    raise AssertionError(f"timed out waiting for {what}")


def finished(cluster: LocalSlurm, job_id: str, output: Path, timeout: float = 300) -> str:
    ended = ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY")
    try:
        return wait_until(lambda: (lambda s: s if s in ended else None)(
            cluster.job_state(job_id)[0]), timeout, f"job {job_id} to end", interval=0.5)
    except AssertionError:
        raise AssertionError(output.read_text()[-4000:] if output.exists() else "no output")


def max_step(run_dir: Path) -> int:
    if not (run_dir / "metrics.jsonl").exists():
        return 0
    return max(step_losses(run_dir), default=0)


def test_generated_job_on_two_nodes_trains_like_torchrun(cluster, tmp_path,
                                                          launch_reference) -> None:
    out_dir = tmp_path / "outputs"
    result = launch(cluster, ["--nodes", "2", "--job-name", "plain", "--",
                              *LAUNCH_RUN, f"train.out_dir={out_dir}"], tmp_path)
    job_id, run_dir, output = submitted(result)
    assert run_dir == out_dir / f"slurm-{job_id}"
    assert finished(cluster, job_id, output) == "COMPLETED", output.read_text()[-4000:]
    log = output.read_text()
    assert "2 nodes x 1 processes; rendezvous 127.0.0.1:" in log
    assert "world 2 (fsdp" in log
    # One run directory (both nodes and ranks wrote to it), beside the job's output file.
    assert sorted(p.name for p in out_dir.iterdir()) == sorted([output.name, run_dir.name])
    assert sorted(step_losses(run_dir)) == list(range(1, 25))
    assert step_losses(run_dir) == step_losses(launch_reference)  # exact, every step


def test_preempted_job_checkpoints_requeues_and_resumes_exactly(cluster, tmp_path,
                                                                launch_reference) -> None:
    out_dir = tmp_path / "outputs"
    result = launch(cluster, ["--nodes", "2", "--job-name", "preempt", "--", *LAUNCH_RUN,
                              f"train.out_dir={out_dir}", "logging.wandb=true"], tmp_path)
    job_id, run_dir, output = submitted(result)
    wait_until(lambda: max_step(run_dir) >= 3, 180, "step 3")
    first_id = (run_dir / "wandb_run_id").read_text().strip()
    # What Slurm does --signal-lead seconds before the time limit, sent by hand.
    subprocess.run(["scancel", "--signal=USR1", job_id], env=cluster.env, check=True)
    # The trainer saves and stops; the job script requeues the job under the same id.
    # (A requeued job starts again once its old credentials expire: AuthInfo=cred_expire.)
    wait_until(lambda: cluster.job_state(job_id)[1] >= 1, 120, "the requeue")
    stopped_at = json.loads(output.read_text().split("stopped: ")[1].split("; requeueing")[0])
    assert finished(cluster, job_id, output) == "COMPLETED", output.read_text()[-4000:]

    log = output.read_text()
    assert stopped_at["reason"] == "SIGUSR1" and 3 <= stopped_at["step"] < 24, stopped_at
    # The requeue the job asked for reads as one: the trainers exited cleanly (no torchrun
    # traceback, no srun error), the script said what happens next, and the next start says
    # how long it waited and until when.
    assert "Traceback" not in log and "srun: error" not in log, log[-4000:]
    assert "(its 'CANCELLED ... DUE TO JOB REQUEUE' line below is this requeue)" in log
    assert "holds the job until its BeginTime, 10 s from now (AuthInfo=cred_expire" in log
    waited = re.search(r"requeued (\d+) s before this start: held (\d+) s until its BeginTime "
                       r"\(the requeue \+ AuthInfo cred_expire\), then (-?\d+) s until", log)
    assert waited, log[-4000:]
    total, held, scheduled = map(int, waited.groups())
    assert 10 <= held <= 13 and total == held + scheduled, waited.group(0)  # cred_expire=10
    assert "blocktrain[job %s]: start 1;" % job_id in log
    assert f"resumed from {run_dir / 'checkpoints' / ('step_%08d' % stopped_at['step'])}" in log
    # Every step's loss equals the uninterrupted run's, including the steps after the resume.
    assert sorted(step_losses(run_dir)) == list(range(1, 25))
    assert step_losses(run_dir) == step_losses(launch_reference)
    # The same W&B run continued: one id, one offline run folder per start, both under it.
    assert (run_dir / "wandb_run_id").read_text().strip() == first_id
    starts = sorted(p.name for p in (run_dir / "wandb").glob("offline-run-*"))
    assert len(starts) == 2 and all(name.endswith(first_id) for name in starts), starts
    assert not (run_dir / "preempted.json").exists()
    assert [m["step"] for m in read_metrics(run_dir) if "val_loss" in m][-1] == 24


def test_bad_requests_are_refused_before_submission(cluster, tmp_path) -> None:
    jobs_before = cluster._run("squeue", "-h", "-o", "%i").stdout.split()
    cases = {
        ("--nodes", "2", "--gpus-per-node", "8"):
            "error: --gpus-per-node: 8 GPUs per node on 2 nodes, but nodes of partition debug "
            "have none (0 nodes have 8)",
        ("--nodes", "3"): "error: --nodes: 3 nodes, but partition debug has 2",
        ("--nodes", "2", "--partition", "gpu"):
            "error: --partition: gpu: no such partition; choose one of debug",
        ("--nodes", "2", "--", "train.steps=abc"):
            "error: train.steps: Value 'abc' of type 'str' could not be converted to Integer",
        ("--nodes", "2", "--", "sharding=hsdp", "sharding.replicate=3"):
            "error: sharding.replicate: 3 does not divide the world size 2",
        ("--nodes", "2", "--time", "00:04:00"):
            "error: --signal-lead: 300 s is not shorter than --time 00:04:00; the trainer "
            "would be stopped at once",
    }
    for args, message in cases.items():
        result = launch(cluster, list(args), tmp_path)
        assert result.returncode == 2, (args, result.stdout, result.stderr)
        assert result.stderr.strip().splitlines() == [message], args
    assert cluster._run("squeue", "-h", "-o", "%i").stdout.split() == jobs_before
    assert not (tmp_path / "outputs").exists()

    ok = launch(cluster, ["--validate", "--nodes", "2", "--", "checkpointing=none,full"], tmp_path)
    assert ok.returncode == 0, ok.stderr
    lines = ok.stdout.strip().splitlines()
    assert len(lines) == 2 and all(line.startswith("ok: blocktrain-") for line in lines), lines
    assert "partition debug: 2 nodes" in lines[0] and "checkpointing=full" in lines[1]
    assert cluster._run("squeue", "-h", "-o", "%i").stdout.split() == jobs_before
