"""A newcomer's first commands (issue 48, items 4-6): `data=chat` with the default model on the demo
chats the project makes, then talking to the result; the quick-start job resuming when started
again; `--help` of the trainer and of launch.run saying what blocktrain adds first."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers import REPO, check_ok, run_trainer, step_losses, subprocess_env
from trainer import cli
from trainer.config import ConfigError
from trainer.validate import validate

pytestmark = pytest.mark.slow

SHORT = ["train.steps=2", "train.micro_batch_size=2", "train.eval_batches=1",
         "logging.every=1", "logging.wandb=false", "logging.progress=false"]


def _python(*args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, *args], cwd=REPO, env=subprocess_env(),
                          capture_output=True, text=True, timeout=timeout)


def test_chat_without_a_path_says_in_one_line_what_to_pass(tmp_path) -> None:
    result = run_trainer(["data=chat", f"data.cache_dir={tmp_path}"], REPO)
    assert result.returncode == 2 and "Traceback" not in result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: data.path: data=chat needs data.path=")
    assert "data.path=demo" in lines[0]


def test_the_chat_demo_fits_the_default_model_without_other_settings(tmp_path) -> None:
    cfg = cli.compose(["data=chat", "data.path=demo", f"data.cache_dir={tmp_path}"])
    validate(cfg, world_size=1)  # raises nothing: seq_len, tokenizer and vocabulary fit
    assert cfg.data.seq_len == cfg.model.max_seq_len == 512
    assert Path(cfg.data.path) == tmp_path / "demo" / "v1" / "chats.jsonl"
    from trainer.data.sources import load_tokenizer

    assert len(load_tokenizer(cfg.data.tokenizer, "chat")) <= cfg.model.vocab_size
    with pytest.raises(ConfigError, match="^data.seq_len: 1024 exceeds model.max_seq_len=512"):
        validate(cli.compose(["data=chat", "data.path=demo", f"data.cache_dir={tmp_path}",
                              "data.seq_len=1024"]), world_size=1)


def test_the_chat_demo_trains_and_then_talks(tmp_path) -> None:
    run_dir = tmp_path / "run"
    check_ok(run_trainer(["data=chat", "data.path=demo", f"data.cache_dir={tmp_path / 'cache'}",
                          *SHORT, f"hydra.run.dir={run_dir}"], REPO, timeout=600))
    assert sorted(step_losses(run_dir)) == [1, 2]
    talked = _python("-m", "trainer.generate", str(run_dir), "--chat", "--message",
                     "the quick brown fox", "--max-new-tokens", "4")
    assert talked.returncode == 0, talked.stderr
    assert talked.stdout.splitlines()[:2][0] == "user: the quick brown fox"
    assert talked.stdout.splitlines()[1].startswith("assistant: ")


def _quickstart(tmp_path: Path, *overrides: str) -> subprocess.CompletedProcess:
    """launch/quickstart.sh train with this interpreter as its set-up environment."""
    venv = tmp_path / "venv"
    if not venv.exists():
        (venv / "bin").mkdir(parents=True)
        python = venv / "bin" / "python"
        python.write_text(f'#!/bin/sh\nexec "{sys.executable}" "$@"\n')
        python.chmod(0o755)
        (venv / ".blocktrain-installed").touch()  # newer than pyproject.toml: no install
    return subprocess.run(["bash", str(REPO / "launch" / "quickstart.sh"), "train", *overrides],
                          env=subprocess_env({"BLOCKTRAIN_VENV": str(venv)}),
                          capture_output=True, text=True, timeout=600)


def test_the_quick_start_started_twice_resumes_and_the_second_ends_at_once(tmp_path) -> None:
    job = [f"train.out_dir={tmp_path / 'outputs'}", "data.seq_len=64", "save.every=1",
           "data.max_corpus_bytes=2000000", *SHORT]
    check_ok(_quickstart(tmp_path, *job))
    run_dir = tmp_path / "outputs" / "quickstart"
    first = step_losses(run_dir)
    assert sorted(first) == [1, 2]
    again = _quickstart(tmp_path, *job)
    check_ok(again)
    assert step_losses(run_dir) == first  # no step ran again
    assert sorted(p.name for p in (tmp_path / "outputs").iterdir()) == ["quickstart"]
    log = (run_dir / "train.log").read_text()
    assert "steps 2 -> 2 of 2" in log, log[-2000:]


def test_trainer_help_says_what_blocktrain_adds_before_hydra() -> None:
    result = _python("-m", "trainer", "--help", timeout=120)
    assert result.returncode == 0, result.stderr
    text = result.stdout
    assert text.startswith("blocktrain: ") and "\ntrain is powered by Hydra" not in text
    order = [text.index(part) for part in ("config groups", "exit statuses", "where runs go",
                                           "blocktrain is powered by Hydra",
                                           "== Configuration groups ==")]
    assert order == sorted(order)
    for status in ("0", "1", "2", "74", "75", "130"):
        assert f"\n  {status} " in text
    groups = sorted(p.name for p in (REPO / "conf").iterdir() if p.is_dir()
                    and not p.name.startswith("_"))
    assert [g for g in groups if g not in cli.GROUPS] == []  # every group is described


def test_launch_run_help_says_what_blocktrain_adds_before_torchrun() -> None:
    result = _python("-m", "launch.run", "--help", timeout=120)
    assert result.returncode == 0, result.stderr
    text = result.stdout
    assert text.startswith("usage: python -m launch.run [torchrun's options] -m trainer")
    order = [text.index(part) for part in ("exit statuses", "where runs go",
                                           "torchrun's own help follows", "--nproc-per-node")]
    assert order == sorted(order)
