"""Benchmark the checkpoint policies and offload targets through the real trainer.

    python -m checkpointing.bench [--steps N] [--nproc P] [--policies a,b] [--targets none,disk]
                                  [trainer overrides ...]

Each (policy, offload target) runs as its own `python -m trainer` (or torchrun) job with the same
overrides. The table shows the median step time (first step excluded) and its ratio to the same
policy without offload (or to `none` for the no-offload rows), the activation bytes kept on the
device, the bytes offloaded per micro-batch, the process peak memory (CUDA: max allocated; CPU:
peak RSS) and how far it fell against no offload, and the profiled recompute time. With
`--repeat R` every figure is the median over R interleaved rounds.
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


def run_policy(policy: str, target: str, overrides: list[str], steps: int, nproc: int,
               out: str) -> list[dict]:
    run_dir = os.path.join(out, f"{policy}-{target}")
    args = [f"checkpointing={policy}", f"offload={target}", f"train.steps={steps}",
            "logging.every=1",
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
    parser.add_argument("--repeat", type=int, default=1,
                        help="rounds over all rows, interleaved; figures are medians over rounds")
    parser.add_argument("--policies", default=",".join(POLICIES))
    parser.add_argument("--targets", default="none", help="offload targets, e.g. none,disk")
    args, overrides = parser.parse_known_args(argv)
    if args.repeat < 1 or args.steps < 2:
        parser.error("--repeat must be >= 1 and --steps >= 2 (the first step is not timed)")
    keys = [(p, t) for p in args.policies.split(",") for t in args.targets.split(",")]
    rounds: dict[tuple[str, str], list[dict]] = {key: [] for key in keys}
    with tempfile.TemporaryDirectory() as out:
        # Rounds over all rows rather than row after row: a slow spell of a shared machine then
        # lands on every row alike instead of on whichever row ran during it.
        for round in range(args.repeat):
            for policy, target in keys:
                logged = run_policy(policy, target, overrides, args.steps, args.nproc,
                                    os.path.join(out, str(round)))
                rounds[policy, target].append({
                    "step": statistics.median(m["step_time_s"] for m in logged[1:]),
                    "saved": max(m["act_saved_bytes"] for m in logged),
                    "offloaded": max(m.get("offloaded_bytes", 0) for m in logged),
                    "peak": max(m["peak_mem_bytes"] for m in logged),
                    "recompute": logged[-1].get("recompute_s", 0.0)})
    rows = {key: {name: statistics.median(r[name] for r in runs) for name in runs[0]}
            for key, runs in rounds.items()}
    print(f"# {datetime.date.today()} {platform.machine()} {os.cpu_count()} cores, "
          f"nproc {args.nproc}: python -m checkpointing.bench --steps {args.steps} "
          f"--repeat {args.repeat} "
          f"--policies {args.policies} --targets {args.targets} " + " ".join(overrides))
    print("| policy | offload | step s | x base | act on device MiB | offloaded MiB | "
          "peak mem MiB | peak fell by MiB | recompute s (profiled) |")
    print("|---|---|---|---|---|---|---|---|---|")
    for (policy, target), r in rows.items():
        base = rows.get((policy, "none")) if target != "none" else rows.get(("none", "none"))
        ratio = r["step"] / base["step"] if base else float("nan")
        fell = (base["peak"] - r["peak"]) / 2**20 if base and target != "none" else 0.0
        print(f"| {policy} | {target} | {r['step']:.3f} | {ratio:.2f} | {r['saved'] / 2**20:.1f} | "
              f"{r['offloaded'] / 2**20:.1f} | {r['peak'] / 2**20:.0f} | {fell:.0f} | "
              f"{r['recompute']:.3f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
