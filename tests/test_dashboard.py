"""W&B dashboards (offline runs read back from their run files): the memory story, alerts for
faults and drift, one W&B run across a stop and a restart, summary fields, the workspace."""

from __future__ import annotations

import glob
import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.helpers import (QUICK, check_ok, read_metrics, read_wandb_records, run_trainer,
                           subprocess_env)
from trainer.preflight.timeline import gib
from trainer.observe.watch import KINDS, Alerts, ThroughputWatch, memory_text

# Throughput alerts only for a drop far beyond a shared test machine's noise (the injected
# slow step is ~15x slower than the others).
ONLINE = ["logging.wandb=true", "logging.every=1", "logging.alert_throughput_fraction=0.2"]
ENV = {"WANDB_MODE": "offline"}


def _wandb(run_dir: Path) -> list[dict]:
    """Per W&B run file of the run directory (one per start): its id, history keys, summary,
    alerts and artifacts."""
    out = []
    for path in sorted((run_dir / "wandb").glob("offline-run-*/run-*.wandb")):
        run = {"id": path.stem[len("run-"):], "keys": set(), "summary": {}, "alerts": [],
               "artifacts": [], "files": path.parent / "files", "config": {}}
        for record in read_wandb_records(path):
            kind = record.WhichOneof("record_type")
            if kind == "history":
                run["keys"] |= {i.key or "/".join(i.nested_key) for i in record.history.item}
            elif kind == "summary":
                for item in record.summary.update:
                    run["summary"][item.key or "/".join(item.nested_key)] = \
                        json.loads(item.value_json)
            elif kind == "alert":
                run["alerts"].append((record.alert.title, record.alert.level, record.alert.text))
            elif kind == "artifact":
                run["artifacts"].append((record.artifact.type, record.artifact.name))
            elif kind == "run":
                run["group"], run["tags"] = record.run.run_group, list(record.run.tags)
        out.append(run)
    return out


def _table(run: dict, key: str) -> list[dict]:
    [path] = (run["files"] / "media" / "table").glob(f"{key}_*.table.json")
    data = json.loads(path.read_text())
    return [dict(zip(data["columns"], row)) for row in data["data"]]


@pytest.fixture(scope="module")
def faulty(tmp_path_factory) -> Path:
    """checkpointing=full, 16 steps: a NaN at batch 3, a slow-down at batch 10, a spike at 12
    (which rolls back to the checkpoint of step 10)."""
    tmp = tmp_path_factory.mktemp("faulty")
    run_dir = tmp / "run"
    result = run_trainer(QUICK + ONLINE + [
        "train.steps=16", "checkpointing=full", "save.every=5", "faults.inject_nan_at=[3]",
        "faults.inject_slow_at=[10]", "faults.inject_slow_s=1.0", "faults.inject_spike_at=[12]",
        "logging.alert_throughput_window=5", "logging.wandb_checkpoint_refs=true",
        f"hydra.run.dir={run_dir}"], cwd=tmp, env=ENV)
    check_ok(result)
    (run_dir / "stdout.txt").write_text(result.stdout + result.stderr)
    return run_dir


@pytest.mark.slow
def test_the_memory_story_reaches_wandb(faulty) -> None:
    [run] = _wandb(faulty)
    assert {"plan/_type", "plan_blocks/_type", "memory_plan/_type",
            "memory_plan_png/_type"} <= run["keys"]
    blocks = _table(run, "plan_blocks")
    assert [b["name"] for b in blocks] == [f"layers.{i}" for i in range(4)]
    for b in blocks:  # every option's bytes from the meta trace, for a profile-free policy too
        assert b["recompute"] == "full"
        assert b["saved_bytes_none"] > b["saved_bytes_selective"] > b["saved_bytes_full"] > 0
        assert b["recompute_flops_full"] > b["recompute_flops_none"] == 0
    assert any(row["phase"] for row in _table(run, "memory_plan"))
    s = run["summary"]
    # Predicted against measured (live tensor bytes at step 2 on CPU): the prediction held.
    assert 0.95 < s["memory/measured_over_predicted"] < 1.05, s
    assert s["memory/measured_as"] == "live tensor bytes"
    assert (faulty / "memory_plan.json").exists() and (faulty / "memory_plan.png").exists()
    # The picture's one-line summary, with the prediction (CPU: no device size to compare with).
    line = next(t for t in (faulty / "stdout.txt").read_text().splitlines()
                if "memory per rank: floor " in t)
    assert f"peak {gib(s['memory/predicted_peak_bytes'])} during " in line and "device" not in line
    # The run's summary fields, its config groups as tags, the checkpoint by reference.
    assert s["final/step"] == 16 and s["final/skipped_steps"] == 2
    assert s["final/best_val_loss"] <= s["final/val_loss"] and s["final/tokens_seen"] > 0
    assert "checkpointing=full" in run["tags"] and "model=tiny" in run["tags"]
    assert ("checkpoint", f"checkpoint-{run['id']}") in run["artifacts"]
    # And the exact command that uploads the offline run.
    sync = [line for line in (faulty / "stdout.txt").read_text().splitlines()
            if "upload with: wandb sync " in line]
    pattern, _, run_id = sync[0].split("wandb sync ")[1].partition(" --id ")
    assert glob.glob(pattern) and all(Path(p).is_dir() for p in glob.glob(pattern))
    assert run_id == run["id"]


@pytest.mark.slow
def test_faults_and_drift_alert(faulty) -> None:
    [run] = _wandb(faulty)
    fired = {title.split()[1].rstrip(":"): text for title, _, text in run["alerts"]}
    assert set(fired) == {"nonfinite", "throughput", "loss_spike", "rollback"}, run["alerts"]
    assert "to the checkpoint of step 10" in fired["rollback"]
    assert "not finite" in fired["nonfinite"] and "tokens/s" in fired["throughput"]
    assert {"alert/nonfinite", "alert/throughput", "alert/loss_spike"} <= run["keys"]
    events = {}
    for m in read_metrics(faulty):
        events.setdefault(m.get("alert"), m)  # the first of each kind
    events.pop(None)
    assert set(events) == set(fired) and all(e["sent"] for e in events.values())
    assert events["throughput"]["step"] == 10  # the slowed batch 10 (batch 3 was skipped)
    log = (faulty / "train.log").read_text()
    assert all(f"ALERT {kind} " in log for kind in fired)


@pytest.mark.slow
def test_a_preempted_and_requeued_run_is_one_wandb_run(tmp_path) -> None:
    """SIGTERM mid-run (what Slurm sends before preempting): saved, a `preemption` alert; the
    same command again continues the same W&B run with a `resumed` alert."""
    run_dir = tmp_path / "run"
    command = [sys.executable, "-m", "trainer", *QUICK, *ONLINE, "data=synthetic",
               "train.steps=40", "save.every=0", "train.eval_every=40", f"hydra.run.dir={run_dir}"]
    process = subprocess.Popen(command, cwd=tmp_path, env=subprocess_env(ENV), text=True,
                               stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 120
        while not (run_dir / "metrics.jsonl").exists() or not any(
                m.get("step", 0) >= 3 and "loss" in m for m in read_metrics(run_dir)):
            assert process.poll() is None and time.monotonic() < deadline
            time.sleep(0.2)
        process.send_signal(signal.SIGTERM)
        assert process.wait(timeout=120) != 0 and (run_dir / "preempted.json").exists()
    finally:
        process.kill()
    stopped_at = json.loads((run_dir / "preempted.json").read_text())["step"]
    again = run_trainer(command[3:], cwd=tmp_path, env=ENV)
    check_ok(again)
    first, second = _wandb(run_dir)
    # The upload command the run ends with takes both starts, as the one run (same id).
    [sync] = [line.split("wandb sync ")[1] for line in again.stdout.splitlines()
              if "upload with: wandb sync " in line]
    pattern, _, run_id = sync.partition(" --id ")
    assert len(glob.glob(pattern)) == 2 and run_id == first["id"]
    assert first["id"] == second["id"] == (run_dir / "wandb_run_id").read_text().strip()
    assert ("preemption:", "WARN") in [(t.split()[1], level) for t, level, _ in first["alerts"]]
    assert any("stopped by SIGTERM" in text for _, _, text in first["alerts"])
    assert [t.split()[1] for t, _, _ in second["alerts"]][0] == "resumed:"
    assert f"after the stop at step {stopped_at} (SIGTERM)" in second["alerts"][0][2]
    assert second["summary"]["final/step"] == 40


@pytest.mark.slow
def test_wandb_off_costs_no_prediction(tmp_path) -> None:
    run_dir = tmp_path / "run"
    check_ok(run_trainer(QUICK + ["train.steps=2", f"hydra.run.dir={run_dir}"], cwd=tmp_path))
    assert not (run_dir / "memory_plan.json").exists() and not (run_dir / "wandb").exists()
    assert not any("live_peak_bytes" in m for m in read_metrics(run_dir))


@pytest.mark.slow
def test_workspace_panels_name_keys_the_trainer_logs(faulty) -> None:
    from trainer.observe.workspace import CONDITIONAL, IMAGES, LINES, SUMMARY_BARS, TABLES, build

    [run] = _wandb(faulty)
    drawn = {key for keys in LINES.values() for key in keys}
    assert drawn - CONDITIONAL <= run["keys"], drawn - CONDITIONAL - run["keys"]
    assert {f"alert/{k}" for k in KINDS} == set(LINES["Alerts"])
    assert set(SUMMARY_BARS) <= set(run["summary"])
    assert {f"{key}/_type" for key in TABLES + IMAGES} <= run["keys"]
    workspace = build("someone", "blocktrain", "blocktrain")
    assert [s.name for s in workspace.sections][-1] == "Alerts"


def test_alerts_are_rate_limited_per_kind() -> None:
    class Logger:
        def __init__(self):
            self.seen = []

        def alert(self, kind, step, text, level, sent, wandb_step):
            self.seen.append((kind, step, sent))

    now = [0.0]
    logger = Logger()
    alerts = Alerts(logger, interval_s=60, clock=lambda: now[0])
    alerts.fire("throughput", 1, "slow")
    alerts.fire("throughput", 2, "slow")
    alerts.fire("nonfinite", 2, "nan")
    now[0] = 61.0
    alerts.fire("throughput", 3, "slow")
    assert logger.seen == [("throughput", 1, True), ("throughput", 2, False),
                           ("nonfinite", 2, True), ("throughput", 3, True)]
    assert alerts.counts == {"throughput": 3, "nonfinite": 1}


def test_throughput_drift_and_memory_texts() -> None:
    watch = ThroughputWatch(0.5, window=5, warmup=2)
    assert [watch.check(v) for v in (1.0, 1.0)] == [None, None]  # warm-up: not counted
    assert all(watch.check(100.0 + i) is None for i in range(5))
    assert "below 0.5 x the running median 102" in watch.check(40.0)
    assert watch.check(45.0) is not None  # a slow spell keeps alerting, not the new normal
    assert watch.check(80.0) is None
    assert ThroughputWatch(0.0, 5, 0).check(0.0) is None  # off
    assert memory_text(110, 100, 0.1, "x") is None
    assert "11% above the predicted peak" in memory_text(111, 100, 0.1, "max allocated")
    assert memory_text(500, None, 0.1, "x") is None


def test_runs_are_grouped_by_slurm_job(monkeypatch) -> None:
    from trainer.observe.dashboard import run_group

    monkeypatch.delenv("SLURM_ARRAY_JOB_ID", raising=False)
    monkeypatch.setenv("SLURM_JOB_ID", "4242")
    assert run_group()[0] == "slurm-4242"  # a requeued job keeps its id, so its group
    monkeypatch.setenv("SLURM_ARRAY_JOB_ID", "77")
    assert run_group()[0] == "slurm-77"


def test_a_misbehaving_wandb_never_fails_the_run() -> None:
    from trainer.observe.wandb_log import WandbLogger

    class Broken:
        id = "x"
        summary = property(lambda self: (_ for _ in ()).throw(RuntimeError("summary")))

        def __getattr__(self, name):
            def fail(*args, **kwargs):
                raise RuntimeError(f"W&B {name} broke")
            return fail

    logger = WandbLogger(Broken())
    logger.alert("t", "x", "WARN")
    logger.summary({"a": 1})
    logger.log_media({"t": ("table", [{"a": 1}])})
    logger.log_table("plan", [{"a": 1}])
    logger.checkpoint_reference("/nonexistent", 3)
    logger.log({"loss": 1.0}, step=1)  # the first failure of log turns W&B off for the run
    assert logger.run is None


def test_the_console_line_is_short_and_the_record_whole() -> None:
    from trainer.observe.metrics import console_line

    record = {"step": 20, "loss": 0.98561, "lr": 6.2e-4, "grad_norm": 2.04, "tokens_per_s": 8878.2,
              "step_time_s": 0.0577, "samples_per_s": 138.7, "data_wait_s": 0.0067,
              "tokens_seen": 10240, "peak_mem_bytes": 837_000_000, "act_saved_bytes": 0}
    assert console_line(record) == "step 20 | loss 0.9856 | 8,878 tok/s | peak 0.78 GiB"
    assert console_line({"step": 0, "val_loss": 1.4271, "val_accuracy": 0.1875}) == \
        "step 0 | val_loss 1.427 | val_accuracy 0.1875"
    assert console_line({"step": 3, "alert": "nan"}) == "step 3 | alert nan"  # events in full
