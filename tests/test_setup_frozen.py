"""The steps run with the start-up's objects out of the collector's full passes, and only then."""

from __future__ import annotations

import gc
import json
import subprocess
import sys

import pytest

from tests.helpers import REPO, subprocess_env
from trainer.loop import setup_frozen

TINY = ["model.dim=32", "model.n_layers=2", "model.n_heads=4", "model.n_kv_heads=2",
        "model.ffn_hidden=64", "model.vocab_size=64", "data=synthetic", "data.seq_len=16",
        "train.micro_batch_size=2", "train.steps=3", "logging.wandb=false",
        "logging.progress=false", "save.resume=false"]


def test_what_exists_is_frozen_inside_and_collectable_again_after() -> None:
    before = gc.get_freeze_count()
    assert before == 0
    with setup_frozen():
        inside = gc.get_freeze_count()
        made_inside = [[] for _ in range(10_000)]  # noqa: F841 (made after the freeze)
        # At most equal: another thread of this worker may free a frozen object meanwhile,
        # but nothing made after the freeze may join the frozen generation.
        assert gc.get_freeze_count() <= inside
    assert inside > 1000  # the interpreter, torch and the test's modules
    assert gc.get_freeze_count() == 0


def test_unfrozen_when_the_steps_fail() -> None:
    with pytest.raises(RuntimeError):
        with setup_frozen():
            raise RuntimeError("a step failed")
    assert gc.get_freeze_count() == 0


_SPY = """
import atexit, gc, json, sys
import trainer.loop as loop
real, seen = loop.train_step, []
def spy(*args, **kwargs):
    seen.append(gc.get_freeze_count())
    return real(*args, **kwargs)
loop.train_step = spy
atexit.register(lambda: print("FROZEN", json.dumps({"steps": seen, "after": gc.get_freeze_count()})))
sys.argv = ["trainer", *sys.argv[1:]]
from trainer.__main__ import main
main()
"""


def test_the_trainer_freezes_for_the_steps_and_unfreezes_at_the_end(tmp_path) -> None:
    done = subprocess.run([sys.executable, "-c", _SPY, *TINY, f"hydra.run.dir={tmp_path}/run"],
                          cwd=REPO, env=subprocess_env(), capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    line = [ln for ln in done.stdout.splitlines() if ln.startswith("FROZEN ")][-1]
    got = json.loads(line.removeprefix("FROZEN "))
    assert len(got["steps"]) == 3
    # The model, its optimizer and the imported modules are tens of thousands of objects.
    assert min(got["steps"]) > 10_000, got
    assert got["after"] == 0, got
