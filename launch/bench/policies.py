"""Benchmark the checkpoint policies and offload targets through the real trainer.

    python -m launch.bench [--steps N] [--nproc P] [--policies a,b] [--targets none,disk]
                                  [trainer overrides ...]
    python -m launch.bench --memory-gib 0.06,0.1,0.2 train.global_batch_size=32 ...
    python -m launch.bench --reference [...]   (against a plain loop: reference.py)
    python -m launch.bench --sequence [...]    (sharding.sequence and tiles: sequence.py)

Each (policy, offload target) runs as its own `python -m trainer` (or torchrun) job with the same
overrides. The table shows the median step time (first step excluded) and its ratio to the same
policy without offload (or to `none` for the no-offload rows), the activation bytes kept on the
device, the bytes offloaded per micro-batch, the process peak memory (CUDA: max allocated; CPU:
peak RSS) and how far it fell against no offload, and the profiled recompute time. With
`--repeat R` every figure is the median over R interleaved rounds.

With `--budgets 0.25,0.5,0.75`, our budget planner, eager and compiled, runs beside
`checkpointing=compiler` (torch.compile's partitioner under the same budget) at each budget, with
`none` eager and compiled for reference: measured activation bytes, step time, and the seconds
from the start to the end of the first step (compiling included).

With `--memory-gib`, each policy (auto among them) runs at each memory level with the micro-batch
chosen to fit it: the table shows what was chosen, the predicted and the measured peak of live
tensor bytes (logging.live_bytes_step), whether it stayed within the level, and the step time
against the fastest uniform policy at the same level.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile

POLICIES = ("none", "full", "every_k", "sqrt", "selective", "budget")  # --policies default


def torch_version() -> str:
    from importlib.metadata import version

    return version("torch")


def run_policy(policy: str, target: str, overrides: list[str], steps: int, nproc: int,
               out: str, allow_no_fit: bool = False,
               decision: str | None = None) -> list[dict] | None:
    """The logged steps of one trainer run; None when allow_no_fit and nothing fits memory.
    decision: an auto.json to start from (the trainer reuses it instead of timing again)."""
    run_dir = os.path.join(out, f"{policy}-{target}")
    if decision is not None:
        os.makedirs(run_dir, exist_ok=True)
        shutil.copy(decision, os.path.join(run_dir, "auto.json"))
    # checkpointing.profile: the fixed policies' profiled recompute seconds (the table's column).
    args = [f"checkpointing={policy}", f"offload={target}", f"train.steps={steps}",
            "logging.every=1", "checkpointing.profile=true",
            "logging.wandb=false", "logging.progress=false", f"train.eval_every={steps}",
            f"hydra.run.dir={run_dir}", *overrides]
    if nproc > 1:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
               f"--nproc-per-node={nproc}", "-m", "trainer", *args]
    else:
        cmd = [sys.executable, "-m", "trainer", *args]
    # Each process its share of the cores (torchrun would set 1 thread and print a banner).
    env = {**os.environ}
    env.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // nproc)))
    result = subprocess.run(cmd, capture_output=True, text=True, env=env)
    if allow_no_fit and result.returncode == 2 and "too small for" in result.stderr:
        return None
    if result.returncode != 0:
        raise SystemExit(f"{policy} failed:\n{result.stderr[-3000:]}")
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        logged = list(map(json.loads, f))
    decision = os.path.join(run_dir, "auto.json")
    if os.path.exists(decision):  # what the fit predicted, beside what was measured
        with open(decision) as f:
            d = json.load(f)["decision"]
        chosen = next(c for c in d["candidates"] if c["chosen"])
        logged.append({"micro_batch": d["micro_batch"], "predicted_peak": d["peak_bytes"],
                       "predicted_step": d["step_s"], "plan": chosen["plan"]})
    return logged


def memory_rows(levels: list[float], policies: list[str], overrides: list[str], steps: int,
                nproc: int, repeat: int, out: str) -> dict[tuple[float, str], dict | None]:
    """Each policy at each train.memory_gib, micro-batch chosen to fit (train.micro_batch_size=
    auto); the live tensor bytes of step 2 and the median step time of the steps after it.
    The first round decides; later rounds carry out the same decision (its auto.json), so every
    round measures the same micro-batch and plan."""
    rounds: dict[tuple[float, str], list[dict]] = {(m, p): [] for m in levels for p in policies}
    for round in range(repeat):
        for level in levels:
            for policy in policies:
                first = os.path.join(out, "0", str(level), f"{policy}-none", "auto.json")
                logged = run_policy(
                    policy, "none", [f"train.memory_gib={level}", "train.micro_batch_size=auto",
                                     "logging.live_bytes_step=2", *overrides],
                    steps, nproc, os.path.join(out, str(round), str(level)), allow_no_fit=True,
                    decision=first if round and os.path.exists(first) else None)
                if logged is None:
                    continue
                timed = [m for m in logged if "step_time_s" in m and m["step"] > 2]
                fit = next(m for m in logged if "micro_batch" in m)
                rounds[level, policy].append({
                    "step": statistics.median(m["step_time_s"] for m in timed),
                    "live": max(m["live_peak_bytes"] for m in logged if "live_peak_bytes" in m),
                    **fit})
    rows: dict[tuple[float, str], dict | None] = {}
    for key, runs in rounds.items():
        if not runs:
            rows[key] = None
            continue
        rows[key] = {**runs[0], "step": statistics.median(r["step"] for r in runs),
                     "live": max(r["live"] for r in runs)}
    return rows


COMPILED = ["train.compile=true"]
VARIANTS = (("none", "eager", []), ("none", "compiled", COMPILED),
            ("budget", "eager", []), ("budget", "compiled", COMPILED),
            ("compiler", "compiled", COMPILED))


def budget_rows(budgets: list[float], overrides: list[str], steps: int, nproc: int, repeat: int,
                out: str) -> dict[tuple[float | None, str, str], dict]:
    """Our planner (eager, compiled) and the compiler's placement at each budget, `none` (eager,
    compiled) once: medians over rounds of the steps after the first two (compiling settles)."""
    keys = [(None if policy == "none" else b, policy, mode) for b in budgets
            for policy, mode, _ in VARIANTS if policy != "none" or b == budgets[0]]
    rounds: dict[tuple, list[dict]] = {key: [] for key in keys}
    for round in range(repeat):
        for budget, policy, mode in keys:
            extra = next(e for p, m, e in VARIANTS if (p, m) == (policy, mode))
            extra = extra + ([] if budget is None else [f"checkpointing.budget={budget}"])
            logged = run_policy(policy, "none", [*extra, *overrides], steps, nproc,
                                os.path.join(out, str(round), f"{budget}-{mode}"))
            start = next(m for m in logged if "to_first_step_s" in m)
            rounds[budget, policy, mode].append({
                "step": statistics.median(m["step_time_s"] for m in logged
                                          if "step_time_s" in m and m["step"] > 2),
                "saved": max(m["act_saved_bytes"] for m in logged if "act_saved_bytes" in m),
                "start": start["to_first_step_s"]})
    return {key: {name: statistics.median(r[name] for r in runs) for name in runs[0]}
            for key, runs in rounds.items()}


def print_budget_table(rows: dict[tuple[float | None, str, str], dict]) -> None:
    none = rows[None, "none", "eager"]
    print("| budget | policy | mode | act kept MiB | x none (eager) | step s | "
          "x budget compiled | s to first step |")
    print("|---|---|---|---|---|---|---|---|")
    for (budget, policy, mode), r in rows.items():
        ours = rows.get((budget, "budget", "compiled"))
        ratio = f"{r['step'] / ours['step']:.2f}" if ours else "-"
        print(f"| {'-' if budget is None else f'{budget:g}'} | {policy} | {mode} | "
              f"{r['saved'] / 2**20:.2f} | {r['saved'] / none['saved']:.2f} | {r['step']:.4f} | "
              f"{ratio} | {r['start']:.1f} |")


def print_memory_table(rows: dict[tuple[float, str], dict | None]) -> None:
    print("| memory GiB | policy | micro-batch | plan | predicted peak MiB | live peak MiB | "
          "within | predicted step s | measured step s | x best uniform |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for level in dict.fromkeys(m for m, _ in rows):
        uniform = [r["step"] for (m, p), r in rows.items()
                   if m == level and p != "auto" and r is not None]
        best = min(uniform) if uniform else None
        for (m, policy), r in rows.items():
            if m != level:
                continue
            if r is None:
                print(f"| {level:g} | {policy} | - | does not fit | - | - | - | - | - | - |")
                continue
            within = "yes" if r["live"] <= level * 2**30 else "NO"
            ratio = f"{r['step'] / best:.2f}" if best else "-"
            print(f"| {level:g} | {policy} | {r['micro_batch']} | {r['plan']} | "
                  f"{r['predicted_peak'] / 2**20:.1f} | {r['live'] / 2**20:.1f} | {within} | "
                  f"{r['predicted_step']:.3f} | {r['step']:.3f} | {ratio} |")


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if "--reference" in argv:  # blocktrain against a plain PyTorch loop: launch/bench/reference.py
        from launch.bench.reference import main as reference

        return reference([a for a in argv if a != "--reference"])
    return policy_tables(argv)


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m launch.bench",
                                     description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--nproc", type=int, default=1)
    parser.add_argument("--repeat", type=int, default=1,
                        help="rounds over all rows, interleaved; figures are medians over rounds")
    parser.add_argument("--policies", default=",".join(POLICIES))
    parser.add_argument("--targets", default="none", help="offload targets, e.g. none,disk")
    parser.add_argument("--memory-gib", default=None,
                        help="comma-separated train.memory_gib levels: every policy (default "
                             "auto,none,full,selective,every_k) at each, its micro-batch chosen "
                             "to fit (needs train.global_batch_size=...)")
    parser.add_argument("--reference", action="store_true",
                        help="blocktrain against a plain PyTorch loop, in paired rounds, with "
                             "per-step counts (launch/bench/reference.py; it also takes "
                             "--models, --micro-batch, --seq, --dropout, --device, --malloc, "
                             "--control, --interleave, --layers, --overrides)")
    parser.add_argument("--sequence", action="store_true",
                        help="sharding.sequence=P against 1 on P ranks (live peak per rank, "
                             "step time) and a tiled against an untiled block "
                             "(launch/bench/sequence.py; it also takes --seq-len, --tiles, "
                             "--repeats)")
    parser.add_argument("--budgets", default=None,
                        help="comma-separated checkpointing.budget fractions: budget (eager, "
                             "compiled) beside checkpointing=compiler at each")
    return parser


def policy_tables(argv: list[str]) -> int:
    parser = _parser()
    args, overrides = parser.parse_known_args(argv)
    if args.repeat < 1 or args.steps < 2:
        parser.error("--repeat must be >= 1 and --steps >= 2 (the first step is not timed)")
    if args.memory_gib is not None:
        if args.steps < 4:
            parser.error("--memory-gib needs --steps >= 4 (step 2 counts live bytes; the "
                         "steps after it are timed)")
        levels = [float(v) for v in args.memory_gib.split(",")]
        policies = (args.policies.split(",") if args.policies != ",".join(POLICIES)
                    else ["auto", "none", "full", "selective", "every_k"])
        with tempfile.TemporaryDirectory() as out:
            rows = memory_rows(levels, policies, overrides, args.steps, args.nproc, args.repeat,
                               out)
        print(f"# {datetime.date.today()} {platform.machine()} {os.cpu_count()} cores, "
              f"nproc {args.nproc}: python -m launch.bench --memory-gib {args.memory_gib} "
              f"--steps {args.steps} --repeat {args.repeat} " + " ".join(overrides))
        print_memory_table(rows)
        return 0
    if args.budgets is not None:
        if args.steps < 4:
            parser.error("--budgets needs --steps >= 4 (the first two steps are not timed)")
        with tempfile.TemporaryDirectory() as out:
            rows = budget_rows([float(v) for v in args.budgets.split(",")], overrides,
                               args.steps, args.nproc, args.repeat, out)
        print(f"# {datetime.date.today()} {platform.machine()} {os.cpu_count()} cores, "
              f"nproc {args.nproc}, torch {torch_version()}: python -m launch.bench "
              f"--budgets {args.budgets} --steps {args.steps} --repeat {args.repeat} "
              + " ".join(overrides))
        print_budget_table(rows)
        return 0
    keys = [(p, t) for p in args.policies.split(",") for t in args.targets.split(",")]
    rounds: dict[tuple[str, str], list[dict]] = {key: [] for key in keys}
    with tempfile.TemporaryDirectory() as out:
        # Rounds over all rows rather than row after row: a slow spell of a shared machine then
        # lands on every row alike instead of on whichever row ran during it.
        for round in range(args.repeat):
            for policy, target in keys:
                logged = run_policy(policy, target, overrides, args.steps, args.nproc,
                                    os.path.join(out, str(round)))
                steps = [m for m in logged if "step_time_s" in m]  # not eval or event records
                rounds[policy, target].append({
                    "step": statistics.median(m["step_time_s"] for m in steps[1:]),
                    "saved": max(m["act_saved_bytes"] for m in steps),
                    "offloaded": max(m.get("offloaded_bytes", 0) for m in steps),
                    "peak": max(m["peak_mem_bytes"] for m in steps),
                    "recompute": steps[-1].get("recompute_s", 0.0)})
    rows = {key: {name: statistics.median(r[name] for r in runs) for name in runs[0]}
            for key, runs in rounds.items()}
    print(f"# {datetime.date.today()} {platform.machine()} {os.cpu_count()} cores, "
          f"nproc {args.nproc}: python -m launch.bench --steps {args.steps} "
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
