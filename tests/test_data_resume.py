"""Whole runs (the real entry point) on changed or unfinished data (issue 39, item 2): a resume on a
grown jsonl is refused in one line saying what changed and goes on with data.on_change=new_epoch;
SIGTERM and Ctrl-C while tokenizing and a full data.cache_dir exit 75 / 130 / 74 with one line
and leave no half-written folder."""

from __future__ import annotations

import json
import signal
import subprocess
import time
from pathlib import Path

import pytest

from tests.helpers import (QUICK, REPO, check_ok, small_tmpfs, step_losses, subprocess_env,
                           trainer_command)
from trainer.data.demo import chat_records, make_tokenizer, write_jsonl

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def tok(tmp_path_factory) -> str:
    return str(make_tokenizer(tmp_path_factory.mktemp("tok") / "chatml"))


def chat_run(tok: str, path: Path, cache: Path, run_dir: Path, *extra: str) -> list[str]:
    return [*QUICK, "data=chat", f"data.path={path}", f"data.tokenizer={tok}",
            f"data.cache_dir={cache}", "data.seq_len=64", "model.vocab_size=320",
            "train.micro_batch_size=2", "train.eval_every=100", "save.every=2",
            f"hydra.run.dir={run_dir}", *extra]


def run(overrides: list[str], timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run(trainer_command(overrides), cwd=REPO, env=subprocess_env(),
                          capture_output=True, text=True, timeout=timeout)


def test_a_resume_on_grown_data_is_refused_then_goes_on_with_new_epoch(tmp_path, tok) -> None:
    path = tmp_path / "chats.jsonl"
    write_jsonl(path, chat_records(60, seed=3))
    overrides = chat_run(tok, path, tmp_path / "cache", tmp_path / "run", "train.steps=4")
    stopped = run([*overrides, "train.stop_at_step=2"])
    assert stopped.returncode == 75, stopped.stderr[-3000:]
    write_jsonl(path, chat_records(100, seed=3))  # 40 records more: other windows
    refused = run(overrides)
    assert refused.returncode == 2 and "Traceback" not in refused.stderr
    line = refused.stderr.strip().splitlines()[-1]
    assert line.startswith("error: data.on_change: the data differs from what the checkpoint "
                           "of step 2 was trained on: data.path grew: ")
    assert "chats.jsonl: " in line and "set data.on_change=new_epoch" in line
    assert not (tmp_path / "run" / "data_changes.json").exists()
    check_ok(run([*overrides, "data.on_change=new_epoch"]))
    assert sorted(step_losses(tmp_path / "run")) == [1, 2, 3, 4]
    events = json.loads((tmp_path / "run" / "data_changes.json").read_text())
    assert [e["step"] for e in events] == [2] and "data.path grew" in events[0]["change"]
    assert events[0]["after"]["windows"]["train"] > events[0]["before"]["windows"]["train"]
    assert events[0]["change"] in (tmp_path / "run" / "train.log").read_text()


@pytest.mark.parametrize("sig, status, says", [
    (signal.SIGTERM, 75, "stopped by SIGTERM while tokenizing"),
    (signal.SIGINT, 130, "interrupted while tokenizing")], ids=["sigterm", "ctrl-c"])
def test_a_signal_while_tokenizing_is_one_line_and_leaves_nothing(tmp_path, tok, sig, status,
                                                                  says) -> None:
    path = write_jsonl(tmp_path / "chats.jsonl", chat_records(30000, seed=4))
    cache = tmp_path / "cache"
    child = subprocess.Popen(trainer_command(chat_run(tok, path, cache, tmp_path / "run",
                                                      "train.steps=2")),
                             cwd=REPO, env=subprocess_env(), stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 120
    while not list(cache.glob("*.lock")) and time.monotonic() < deadline:
        time.sleep(0.1)  # the lock appears as tokenizing starts
    time.sleep(1.0)
    assert child.poll() is None, "tokenizing finished before the signal"
    child.send_signal(sig)
    _, err = child.communicate(timeout=120)
    assert child.returncode == status, err[-3000:]
    assert "Traceback" not in err and err.strip().splitlines()[-1].startswith(says)
    assert [p.name for p in cache.iterdir() if p.is_dir()] == []  # no temporary, no folder


def test_a_full_cache_dir_exits_74_with_one_line(tmp_path, tok) -> None:
    with small_tmpfs(tmp_path / "small", "1m") as mount:
        path = write_jsonl(tmp_path / "chats.jsonl", chat_records(600, seed=5))
        result = run(chat_run(tok, path, mount, tmp_path / "run", "train.steps=1",
                              "data.seq_len=512", "data.packing=false"))
        assert result.returncode == 74, result.stderr[-3000:]
        line = result.stderr.strip().splitlines()[-1]
        assert "Traceback" not in result.stderr and line.startswith(
            f"error: data.cache_dir: no space left in {mount} while caching the tokenized data")
        assert [p.name for p in mount.iterdir() if p.is_dir()] == []
