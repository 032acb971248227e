"""launch/bench/sequence.py (`python -m launch.bench --sequence`) measures what it says: tiles
lower a recomputed block's peak with the same gradients, and the whole bench runs and prints its
two tables (the figures themselves: launch/bench/BENCHMARKS.md)."""

from __future__ import annotations

import subprocess
import sys

import pytest

from launch.bench.sequence import block_rows
from tests.helpers import REPO, subprocess_env


def test_tiles_lower_the_blocks_peak_with_the_same_gradients() -> None:
    rows = block_rows(256, [1, 4], repeats=1)
    assert rows[4]["peak"] < 0.9 * rows[1]["peak"], rows
    want = rows[1]["grad"]
    assert ((rows[4]["grad"] - want).abs().max() / want.abs().max()).item() < 1e-6


@pytest.mark.slow
def test_the_bench_prints_both_tables() -> None:
    ran = subprocess.run([sys.executable, "-m", "launch.bench", "--sequence", "--seq-len", "128",
                          "--steps", "4", "--tiles", "1,2", "--repeats", "1"], cwd=REPO,
                         env=subprocess_env(), capture_output=True, text=True, timeout=600)
    assert ran.returncode == 0, ran.stderr[-3000:]
    lines = ran.stdout.splitlines()
    degrees = [line.split() for line in lines if line.strip().split(" ")[0] in ("1", "2")]
    assert [row[0] for row in degrees] == ["1", "2", "1", "2"], ran.stdout  # both tables' rows
    assert float(degrees[1][2]) < 1.0, ran.stdout  # N=2 holds less per rank than N=1
    assert float(degrees[0][-1]) == pytest.approx(float(degrees[1][-1]), rel=1e-5)  # last loss
