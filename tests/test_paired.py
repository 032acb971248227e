"""launch.bench.paired: blocktrain's per-block plan and the plain loop's wrapping, step by step."""

from __future__ import annotations

import argparse
import subprocess
import sys

import pytest

from launch.bench import paired
from tests.helpers import REPO, subprocess_env

SMALL = ["--dim", "32", "--ffn", "64", "--vocab", "64", "--seq", "16", "--micro-batch", "2",
         "--steps", "4", "--warmup", "1"]


def test_every_policy_gives_a_row_with_bitwise_equal_losses() -> None:
    done = subprocess.run([sys.executable, "-m", "launch.bench.paired", *SMALL], cwd=REPO,
                          env=subprocess_env(), capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr[-3000:]
    rows = [ln for ln in done.stdout.splitlines() if ln.startswith("| ") and "---" not in ln][1:]
    assert [r.split("|")[1].strip() for r in rows] == ["none", "full", "selective"]
    for r in rows:
        ratio = float(r.split("|")[2].split()[0])
        assert 0.2 < ratio < 5, r  # a ratio of two step times, not a count or a sum
        assert r.rstrip().endswith("| yes |"), r


def test_a_loss_that_differs_is_reported_and_fails(world_of_one, monkeypatch, capsys) -> None:
    real = paired._plain_loss
    monkeypatch.setattr(paired, "_plain_loss", lambda *args: real(*args) * (1 + 2**-20))
    assert paired.main([*SMALL, "--policies", "full"]) == 1
    assert capsys.readouterr().out.rstrip().endswith("| NO |")


@pytest.mark.parametrize("policy", ["none", "selective"])
def test_the_two_sides_are_the_same_arithmetic(world_of_one, policy) -> None:
    a = argparse.Namespace(**{**paired.SHAPES, "dim": 32, "ffn": 64, "vocab": 64}, seq=16,
                           micro_batch=2, steps=3, warmup=0, seed=0, rank=0, world=1)
    got = paired.compare(a, policy)
    assert got["equal"] and len(got["ratios"]) == 3
