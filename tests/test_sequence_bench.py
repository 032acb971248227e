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


@pytest.mark.slow
def test_the_bench_with_a_ring_prints_its_row() -> None:
    """--context 2 on 2 ranks: a third row (sequence 1 x ring 2) whose ratio column is the live
    peak over the first row's, below 1, and whose last loss is the one-rank-per-sample loss."""
    ran = subprocess.run([sys.executable, "-m", "launch.bench", "--sequence", "--nproc", "2",
                          "--context", "2", "--seq-len", "128", "--steps", "4", "--tiles", "1",
                          "--repeats", "1"], cwd=REPO, env=subprocess_env(),
                         capture_output=True, text=True, timeout=900)
    assert ran.returncode == 0, ran.stderr[-3000:]
    lines = ran.stdout.splitlines()
    header = next(i for i, line in enumerate(lines) if line.split()[:1] == ["sharding.sequence"])
    rows = {line.split()[0]: [float(x) for x in line.split()[1:]]
            for line in lines[header + 1:header + 4]}
    assert list(rows) == ["1", "2", "1xctx2"], ran.stdout
    live, ratio, _, _, loss = zip(*rows.values())
    slack = 0.05 / live[0] + 5e-4  # the MiB column is printed to 0.1, the ratio to 0.001
    assert ratio[0] == 1.0 and all(r == pytest.approx(p / live[0], abs=slack)
                                   for r, p in zip(ratio, live)), ran.stdout
    assert ratio[2] < 1.0, ran.stdout  # the ring holds less per rank than one rank per sample
    assert loss[2] == pytest.approx(loss[0], rel=1e-5), ran.stdout  # the same loss
