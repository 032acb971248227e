"""Training pieces: LR schedule, W&B that hangs, data sources and precision options end to end."""

from __future__ import annotations

import math
import sys
import time
import types

import pytest

from tests.helpers import QUICK, check_ok, losses, read_metrics, run_trainer
from trainer.config import OptimConfig
from trainer.optim import lr_at


def test_warmup_then_cosine() -> None:
    cfg = OptimConfig(lr=1.0, warmup_steps=10, min_lr_ratio=0.1)
    lrs = [lr_at(step, cfg, total_steps=110) for step in range(110)]
    assert lrs[0] == pytest.approx(0.1) and lrs[9] == pytest.approx(1.0)
    assert all(a < b for a, b in zip(lrs[:10], lrs[1:10]))  # rising during warmup
    assert all(a >= b for a, b in zip(lrs[10:], lrs[11:]))  # then never rising
    assert lrs[60] == pytest.approx(0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * 0.5)))
    assert lr_at(110, cfg, 110) == pytest.approx(0.1)


def test_hanging_wandb_init_does_not_stall(monkeypatch, tmp_path) -> None:
    from trainer.observe import wandb_log

    fake = types.SimpleNamespace(init=lambda **kw: time.sleep(60), Settings=lambda **kw: None)
    monkeypatch.setitem(sys.modules, "wandb", fake)
    started = time.monotonic()
    assert wandb_log.WandbLogger.start(str(tmp_path), {}, "p", None, "r", timeout_s=0.5) is None
    assert time.monotonic() - started < 10


def test_failing_wandb_init_does_not_stop_training(monkeypatch, tmp_path) -> None:
    from trainer.observe import wandb_log

    def broken(**kwargs):
        raise RuntimeError("service unreachable")

    monkeypatch.setitem(sys.modules, "wandb", types.SimpleNamespace(init=broken,
                                                                    Settings=lambda **kw: None))
    assert wandb_log.WandbLogger.start(str(tmp_path), {}, "p", None, "r", timeout_s=5) is None


@pytest.mark.slow
def test_token_files_from_the_tokenize_command_train(tmp_path) -> None:
    from trainer.data.tokenize import main as tokenize

    corpus = tmp_path / "corpus"
    corpus.mkdir()
    for i in range(12):
        (corpus / f"doc{i}.txt").write_text(f"document {i}: " + "the quick brown fox " * 200)
    assert tokenize([str(corpus), "--out", str(tmp_path / "tok"), "--val-fraction", "0.2"]) == 0
    run_dir = tmp_path / "run"
    check_ok(run_trainer(QUICK + ["data=tokens", f"data.train_path={tmp_path / 'tok/train.bin'}",
                                  f"data.val_path={tmp_path / 'tok/val.bin'}", "data.seq_len=64",
                                  "train.steps=8", f"hydra.run.dir={run_dir}"], cwd=tmp_path))
    values = losses(run_dir)
    assert len(values) == 8 and values[-1] < values[0]


@pytest.mark.slow
@pytest.mark.parametrize("overrides", [
    ["sharding.param_dtype=bfloat16", "sharding.reduce_dtype=float32"],
    ["sharding.reshard_after_forward=false", "data=synthetic"],
], ids=["bf16-params", "no-reshard-synthetic"])
def test_sharding_options_train(overrides, tmp_path) -> None:
    run_dir = tmp_path / "run"
    check_ok(run_trainer(QUICK + overrides + ["train.steps=4", f"hydra.run.dir={run_dir}"],
                         cwd=tmp_path, nproc=2))
    logged = [m for m in read_metrics(run_dir) if "loss" in m]
    assert len(logged) == 4 and all(math.isfinite(m["loss"]) for m in logged)
