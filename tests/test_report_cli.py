"""The pre-flight memory report's command line: 8B and 70B tables in under a minute, its files
and picture, advice that works when applied, one-line errors (the memory model itself is
tests/test_report.py's)."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from tests.helpers import REPO, config, subprocess_env
from tests.test_report import TINY
from trainer.cli import check
from trainer.models.families.llama import llama_args
from trainer.models.llama import build_llama

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
SECONDS_LIMIT = 60


def _plan_cli(args: list[str], cwd: Path) -> tuple[subprocess.CompletedProcess, float]:
    started = time.perf_counter()
    result = subprocess.run([sys.executable, "-m", "trainer.report", *args], cwd=cwd,
                            env=subprocess_env(), capture_output=True, text=True, timeout=300)
    return result, time.perf_counter() - started


def _param_bytes_per_rank(overrides: list[str], shard: int) -> int:
    """FSDP2's local shard of every distinct parameter: chunk 0 of dim 0 (padded), fp32 (the
    sharded parameters stay fp32 under bf16 mixed precision too)."""
    model = build_llama(llama_args(config(*overrides).model), device="meta")
    return sum(torch.chunk(p, shard, dim=0)[0].numel() * p.element_size()
               for p in model.parameters())


LONG = ["data=synthetic", "data.seq_len=8192", "train.micro_batch_size=1", "checkpointing=full"]


@pytest.mark.parametrize("name,flags,shard,rows", [
    ("llama_8b", ["--world-size", "8"], 8, "layers.0-31 x32"),
    ("llama_70b", ["--world-size", "64", "--nodes", "8"], 64, "layers.0-79 x80"),
])
def test_report_for_real_models_in_under_a_minute(tmp_path, name, flags, shard, rows) -> None:
    overrides = [f"model={name}", *LONG]
    result, seconds = _plan_cli([*overrides, *flags, "--out", str(tmp_path / "out")], tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    assert seconds < SECONDS_LIMIT, seconds
    print(result.stdout)
    assert rows in result.stdout and "predicted peak" in result.stdout
    assert "memory per rank: floor " in result.stdout  # the picture's line
    assert "no verdict" in result.stdout  # CPU, no --gpu-memory-gib
    assert "param dtype bfloat16" in result.stdout  # the big presets' default (conf/precision)
    png = (tmp_path / "out" / "memory_plan.png").read_bytes()
    assert png.startswith(PNG_SIGNATURE) and len(png) > 10_000
    data = json.loads((tmp_path / "out" / "memory_plan.json").read_text())
    assert data["param_dtype"] == "bfloat16"
    assert data["per_rank_bytes"]["params"] == _param_bytes_per_rank(overrides, shard)
    assert data["shard"] == shard and len(data["blocks"]) == (32 if name == "llama_8b" else 80)
    assert data["per_rank_bytes"]["predicted_peak"] == data["peak_phase"]["total"]


def _apply(base: list[str], change: str) -> list[str]:
    """The base command line with a suggested change: flags are given again (the last one wins
    in argparse); overrides of the same key are replaced."""
    words = change.split()
    keys = {w.split("=", 1)[0] for w in words if "=" in w}
    return [w for w in base if w.split("=", 1)[0] not in keys] + words


@pytest.mark.slow
def test_not_fit_advice_is_predicted_to_fit_when_applied(tmp_path) -> None:
    # fp32 on purpose (the preset's default is bf16): the advice must try bf16 parameters.
    base = ["model=llama_70b", *LONG, "sharding.param_dtype=null", "sharding.reduce_dtype=null",
            "--world-size", "8", "--gpu-memory-gib", "80"]
    result, seconds = _plan_cli([*base, "--out", str(tmp_path / "a")], tmp_path)
    assert result.returncode == 3, result.stderr[-3000:]  # does not fit: 3, for job scripts
    assert "does NOT fit (needs" in result.stdout and seconds < SECONDS_LIMIT
    data = json.loads((tmp_path / "a" / "memory_plan.json").read_text())
    fitting = [s for s in data["suggestions"] if s["fits"]]
    assert data["fits"] is False and fitting
    # Half-precision parameters and parameters in host memory are among what is tried.
    changes = {s["change"] for s in data["suggestions"]}
    assert {"sharding.param_dtype=bfloat16 sharding.reduce_dtype=float32",
            "sharding.cpu_offload=true"} <= changes
    offloaded = next(s for s in data["suggestions"] if s["change"] == "sharding.cpu_offload=true")
    assert offloaded["host_bytes"] > 0 and offloaded["peak_phase"]["optimizer"] == 0
    assert all(s["change"] in result.stdout for s in fitting)
    change = fitting[0]
    result, _ = _plan_cli([*_apply(base, change["change"]), "--out", str(tmp_path / "b")],
                          tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "fits: predicted peak" in result.stdout
    applied = json.loads((tmp_path / "b" / "memory_plan.json").read_text())
    assert applied["fits"] is True
    assert applied["per_rank_bytes"] == change["per_rank_bytes"]


@pytest.mark.parametrize("args,start", [
    (["model=gpt5"], "error: model=gpt5: unknown model"),
    (["train.steps=abc"], "error: train.steps:"),
    (["--world-size", "0"], "error: --world-size: must be a positive integer"),
    (["--world-size", "8", "--nodes", "3"], "error: --nodes: 3 must be positive and divide"),
    (["--bogus"], "error: unrecognized arguments: --bogus"),
    (["sharding=hsdp", "sharding.replicate=3", "--world-size", "8"],
     "error: sharding.replicate: 3 does not divide the world size 8"),
    (["checkpointing=budget", "checkpointing.budget=1000"],
     "error: checkpointing.budget: 1000 bytes"),
])
def test_bad_input_is_one_line_and_exit_2(tmp_path, args, start) -> None:
    result, _ = _plan_cli([*args, "--out", str(tmp_path)], tmp_path)
    assert result.returncode == 2, result.stderr
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith(start), result.stderr
    assert result.stdout == ""


def test_the_picture_shows_the_floor_the_head_the_capacity_and_the_peak(tmp_path) -> None:
    from trainer.preflight.plot import plot_plan
    from trainer.preflight.scenario import Evaluator, Scenario
    from trainer.preflight.timeline import gib

    cfg, layout = check([*TINY, "checkpointing=budget"], {"WORLD_SIZE": "1"})
    outcome = Evaluator(400.0).evaluate(Scenario(cfg, layout, 1))
    peak, head = outcome.estimate.peak, outcome.profile.head
    labels = plot_plan(outcome, str(tmp_path / "a.png"), capacity=3 * 2**30)
    assert {"parameters + optimizer state", "gradients", "unsharded copies, temporaries",
            "activations (saved; in backward + working set)"} <= set(labels)
    assert f"the head (output layer, loss): +{gib(head.saved_bytes + head.extra_bytes)}" in labels
    # 3 GiB is far above this step: drawn off the scale, with what is left at the peak.
    assert (f"device memory 3.00 GiB (above this scale: {gib(3 * 2**30 - peak.total)} free at "
            "the peak)") in labels
    assert f"predicted peak {gib(peak.total)}\nduring {peak.name}" in labels
    assert f"activation budget {gib(outcome.budget.bytes)} (over the floor)" in labels
    # The budget plan keeps some blocks whole and recomputes others: both colours are named.
    assert {"recompute none", "recompute full"} <= set(labels)
    assert (tmp_path / "a.png").read_bytes().startswith(PNG_SIGNATURE)
    without = plot_plan(outcome, str(tmp_path / "b.png"))
    assert not any("device memory" in label for label in without)
    near = plot_plan(outcome, str(tmp_path / "c.png"), capacity=int(1.2 * peak.total))
    assert f"device memory {gib(int(1.2 * peak.total))}" in near  # on the scale: no note


def test_plan_module_still_imports_without_torch() -> None:
    """checkpointing.plan stays a plain module (the config schema imports it)."""
    code = "import sys, checkpointing.plan; assert 'torch' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], cwd=REPO, env=subprocess_env(), check=True)


def test_report_writes_apart_from_runs_unless_told(tmp_path) -> None:
    """No --out: a new folder under <train.out_dir>/reports, never a run directory."""
    for _ in range(2):
        result, _ = _plan_cli(["data=synthetic"], tmp_path)
        assert result.returncode == 0, result.stderr[-3000:]
    reports = sorted((tmp_path / "outputs" / "reports").iterdir())
    assert len(reports) == 2 and all((r / "memory_plan.json").exists() for r in reports)
    assert sorted(p.name for p in (tmp_path / "outputs").iterdir()) == ["reports"]
