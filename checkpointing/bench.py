"""Benchmark the checkpoint policies through the real trainer and print a table.

    python -m checkpointing.bench [--steps N] [--nproc P] [trainer overrides ...]

Each policy runs as its own `python -m trainer` (or torchrun) job with the same overrides; the
table shows the median step time (first step excluded), its ratio to `none`, the measured
activation bytes kept for backward, the process peak memory and the profiled recompute time.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile

POLICIES = ("none", "full", "every_k", "sqrt", "selective", "budget")


def run_policy(policy: str, overrides: list[str], steps: int, nproc: int, out: str) -> list[dict]:
    run_dir = os.path.join(out, policy)
    args = [f"checkpointing={policy}", f"train.steps={steps}", "logging.every=1",
            "logging.wandb=false", "logging.progress=false", f"train.eval_every={steps}",
            f"hydra.run.dir={run_dir}", *overrides]
    if nproc > 1:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
               f"--nproc-per-node={nproc}", "-m", "trainer", *args]
    else:
        cmd = [sys.executable, "-m", "trainer", *args]
    result = subprocess.run(cmd, capture_output=True, text=True)
    if result.returncode != 0:
        raise SystemExit(f"{policy} failed:\n{result.stderr[-3000:]}")
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        return [m for m in map(json.loads, f) if "loss" in m]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--nproc", type=int, default=1)
    parser.add_argument("--policies", default=",".join(POLICIES))
    args, overrides = parser.parse_known_args(argv)
    rows = []
    with tempfile.TemporaryDirectory() as out:
        for policy in args.policies.split(","):
            logged = run_policy(policy, overrides, args.steps, args.nproc, out)
            rows.append((policy, statistics.median(m["step_time_s"] for m in logged[1:]),
                         max(m["act_saved_bytes"] for m in logged),
                         max(m["peak_mem_bytes"] for m in logged),
                         logged[-1].get("recompute_s", 0.0)))
    base_time = next(r[1] for r in rows if r[0] == "none") if rows[0][0] == "none" else rows[0][1]
    print(f"# {datetime.date.today()} {platform.machine()} {os.cpu_count()} cores, "
          f"nproc {args.nproc}: python -m checkpointing.bench --steps {args.steps} "
          + " ".join(overrides))
    print("| policy | step s | x none | act saved MiB | peak mem MiB | recompute s (profiled) |")
    print("|---|---|---|---|---|---|")
    for policy, step, saved, peak, recompute in rows:
        print(f"| {policy} | {step:.3f} | {step / base_time:.2f} | {saved / 2**20:.1f} | "
              f"{peak / 2**20:.0f} | {recompute:.3f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
