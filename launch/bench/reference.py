"""blocktrain against a plain PyTorch loop doing the same arithmetic: the framework's tax.

    python -m launch.bench --reference [--nproc 2] [--repeat 3] [--steps 12]
        [--policies none,full,selective] [--models llama,hf] [--micro-batch 8] [--seq 256]
        [--interleave steps|runs] [--layers 4]
        [--control]   (the plain loop on both sides: the spread this machine reads for equal
                       programs, the yardstick for any ratio above)

For each model (the built-in Llama, and a Hugging Face Qwen2 through model=hf) and each policy,
`python -m trainer` and the plain loop of launch/bench/plain.py (the GPU check's reference:
`fully_shard` per block and root, `torch.utils.checkpoint` per block, AdamW, the same data,
initialisation and schedule, so the losses agree bitwise) run with the same shapes on the same
ranks, in pairs, each round over every pair, which one starts alternating between rounds. By
default (`--interleave steps`) the two run at once and take turns a step each
(launch/bench/turns.py): a slow spell of a shared machine then falls on both, where with
`--interleave runs` (one whole run, then the other) it falls on one, and equal programs read
0.90-1.16x here (2026-12-02) against 0.97-1.03x taking turns. Both are timed by one clock read in
a global optimizer post-hook (launch/bench/stepcount.py), so a step is the same span for both:
from one optimizer step to the next, the loop's own work (logging, votes, reading the batch)
included, the wait for the turn not. Printed per pair: the median over rounds of the ratio of
median step times (blocktrain / plain) and its range, the ratio of peak memory, the seconds from
launch to the end of the first step, the CPU a process used while it waited for its turn (work
of its other threads that the turns hide from its step time), and whether the losses agree. Then,
from one counting run of each (no clock), per step: dispatched operators, hooks fired, host
reads of device values (each a synchronisation on a GPU) and Python calls, and every count
blocktrain has beyond the plain loop, with the reason it is there (NAMED_EXTRAS) or flagged as
unnamed.
"""

from __future__ import annotations

import argparse
import collections
import datetime
import json
import os
import platform
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Optional

from launch.bench import turns

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

LLAMA = {"model.dim": 128, "model.n_layers": 4, "model.n_heads": 4, "model.n_kv_heads": 2,
         "model.ffn_hidden": 384, "model.vocab_size": 256, "model.rope_theta": 10000.0}
QWEN2 = {"model_type": "qwen2", "vocab_size": 256, "hidden_size": 128,
         "intermediate_size": 384, "num_hidden_layers": 4, "num_attention_heads": 4,
         "num_key_value_heads": 2}
WARMUP = 2  # step intervals left out of the timing (the first steps warm caches and allocators)
# glibc's malloc moves its mmap and trim thresholds as a process frees large blocks, so two
# processes doing the same step can differ in how many pages they fault in again every step, by
# their history alone (measured: 1-1,500 against 3,000-6,600 a step, selective, 2026-12-01).
# blocktrain's CPU runs now fix their own at glibc's ceilings (train.cpu_heap=steady), the
# plain loop's move as they come: that is `--malloc default`. `--malloc fixed` runs both sides
# with the same fixed thresholds (blocktrain leaves MALLOC_* as set), the allocator taken out
# of the comparison (the memory column then counts every block ever taken: read it under the
# default).
MALLOC = {"MALLOC_MMAP_THRESHOLD_": str(2**30), "MALLOC_TRIM_THRESHOLD_": str(2**32)}

# What blocktrain does per step beyond the plain loop, on a step that is not logged: the most of
# each it may do, and why. Anything else is flagged (tests/test_reference_bench.py fails on it).
NAMED_EXTRAS = {
    "c10d.allreduce_.default": (1, "the loss's mean over ranks (the logged loss and the fault "
                                   "guard's, faults.*) and the stop vote (StopVote), summed "
                                   "together in host memory"),
    "aten.lift_fresh.default": (1, "that all-reduce's host tensor: this rank's loss and ballot"),
    "aten.slice.Tensor": (1, "the loss's mean: the summed loss / world, in place"),
    "aten.div_.Tensor": (1, "the loss's mean: / world"),
    "aten.detach.default": (1, "the step's loss, detached to be averaged"),
    "aten.stack.default": (1, "loss and gradient norm stacked: read together, once"),
    "aten.view.default": (1, "the gradient norm gathered (DTensor.full_tensor) before clipping; "
                             "clip_grad_norm_ gathers it inside a DTensor op the count does not "
                             "see into"),
    "tolist": (2, "loss and gradient norm, read before the update for the fault guard; the "
                  "loss's mean and the vote's result (host memory: no device wait)"),
    "cuda.synchronize": (1, "on a GPU, the step's time includes the device's work (the plain "
                            "loop's loss.item() waits at its end instead)"),
}


def shapes(model: str, layers: int) -> dict:
    """The Llama's trainer settings, or the Qwen2's config, with `layers` blocks."""
    return ({**LLAMA, "model.n_layers": layers} if model == "llama" else
            {**QWEN2, "num_hidden_layers": layers})


def trainer_args(model: str, policy: str, a, run_dir: str) -> list[str]:
    shape = shapes(model, a.layers)
    model_args = ([f"{k}={v}" for k, v in shape.items()] + ["model.tie_embeddings=false"]
                  if model == "llama" else
                  ["model=hf", "model.hf_config=" + json.dumps(shape).replace('"', "")])
    return [f"checkpointing={policy}", *model_args, "data=synthetic", f"data.seq_len={a.seq}",
            f"train.micro_batch_size={a.micro_batch}", f"train.steps={a.steps}",
            f"train.device={a.device}", "logging.wandb=false", "logging.progress=false",
            f"model.dropout={a.dropout}" if model == "llama" else "model.dropout=0",
            "save.resume=false", f"hydra.run.dir={run_dir}", *a.overrides.split()]


def reference_args(model: str, policy: str, a) -> list[str]:
    common = ["--policy", policy, "--seq", str(a.seq), "--micro-batch", str(a.micro_batch),
              "--steps", str(a.steps), "--param-dtype", "none", "--device", a.device]
    if model == "hf":
        return [*common, "--hf-config", json.dumps(shapes(model, a.layers))]
    flags = {"model.dim": "--dim", "model.n_layers": "--layers", "model.n_heads": "--heads",
             "model.n_kv_heads": "--kv-heads", "model.ffn_hidden": "--ffn",
             "model.vocab_size": "--vocab", "model.rope_theta": "--rope-theta"}
    return [*common, *[x for k, v in shapes(model, a.layers).items() for x in (flags[k], str(v))],
            "--untied", "--dropout", str(a.dropout)]


def is_ours(side: str, a) -> bool:
    """Whether this side runs blocktrain (--control: the plain loop on both sides)."""
    return side == "bt" and not a.control


def command(side: str, model: str, policy: str, a, where: str, timing: bool,
            turns: str = "") -> list[str]:
    """The command line of one run under launch/bench/stepcount.py."""
    ours = is_ours(side, a)
    module, args = (("trainer", trainer_args(model, policy, a, os.path.join(where, "run")))
                    if ours else ("launch.bench.plain", reference_args(model, policy, a)))
    wrapper = ["-m", "launch.bench.stepcount", *(["--times"] if timing else []),
               *(["--turns", turns] if turns else []), where, module]
    launcher = ([sys.executable, "-m", "torch.distributed.run", "--standalone",
                 f"--nproc-per-node={a.nproc}"] if a.nproc > 1 else [sys.executable])
    return [*launcher, *wrapper, *args]


def start(side: str, model: str, policy: str, a, where: str, timing: bool,
          turns: str = "") -> tuple[subprocess.Popen, float]:
    env = {**os.environ, **(MALLOC if a.malloc == "fixed" else {}),
           "OMP_NUM_THREADS": str(max(1, (os.cpu_count() or 1) // a.nproc))}
    # Output to files, not pipes: a pipe nobody reads while the other program runs could fill.
    with open(where + ".out", "w") as out, open(where + ".err", "w") as err:
        return subprocess.Popen(command(side, model, policy, a, where, timing, turns),
                                stdout=out, stderr=err, env=env, cwd=ROOT,
                                start_new_session=True), time.time()


def finish(side: str, model: str, policy: str, a, where: str, started: tuple) -> dict:
    """Waits for a run; its per-rank results, launch-to-first-step seconds and losses."""
    process, launched = started
    if process.wait() != 0:
        with open(where + ".err") as err:
            raise SystemExit(f"{side} {model} {policy} failed:\n{err.read()[-3000:]}")
    ranks = [json.load(open(os.path.join(where, f"rank{r}.json"))) for r in range(a.nproc)]
    result = {"ranks": ranks, "losses": {}}
    if isinstance(ranks[0], dict):  # a timed run (a counting run's file lists its intervals)
        result["startup_s"] = ranks[0]["first_step_unix"] - launched
    if not is_ours(side, a):
        with open(where + ".out") as out:
            line = [ln for ln in out.read().splitlines() if ln.startswith("{")][-1]
        result["losses"] = dict(enumerate(json.loads(line)["losses"], start=1))
    else:
        with open(os.path.join(where, "run", "metrics.jsonl")) as f:
            result["losses"] = {m["step"]: m["loss"] for m in map(json.loads, f) if "loss" in m}
    return result


def run(side: str, model: str, policy: str, a, out: str, timing: bool) -> dict:
    """One run of blocktrain ("bt") or the plain loop ("plain"), alone."""
    where = os.path.join(out, f"{model}-{policy}-{side}-{'t' if timing else 'c'}")
    os.makedirs(out, exist_ok=True)
    return finish(side, model, policy, a, where, start(side, model, policy, a, where, timing))


def run_turns(sides: tuple[str, str], model: str, policy: str, a, out: str) -> dict:
    """Both runs at once, taking turns a step each (launch/bench/turns.py): sides[0] starts,
    sides[1] is launched once sides[0] has ended its first step and waits for its turn."""
    folder = os.path.join(out, f"{model}-{policy}-turns")
    turns.make(folder, a.nproc)
    where = {s: os.path.join(out, f"{model}-{policy}-{s}-t") for s in sides}
    first = start(sides[0], model, policy, a, where[sides[0]], True, folder + ":first")
    while not turns.ready(folder, a.nproc):
        if first[0].poll() is not None:
            finish(sides[0], model, policy, a, where[sides[0]], first)  # its error, if it failed
            raise SystemExit(f"{sides[0]} {model} {policy} ended before its first step")
        time.sleep(0.01)
    second = start(sides[1], model, policy, a, where[sides[1]], True, folder + ":second")
    try:
        got = {sides[1]: finish(sides[1], model, policy, a, where[sides[1]], second)}
    except SystemExit:
        os.killpg(first[0].pid, signal.SIGKILL)  # its ranks may wait for a turn that never comes
        raise
    return {sides[0]: finish(sides[0], model, policy, a, where[sides[0]], first), **got}


def per_step(result: dict, key: str, typical=statistics.median) -> float:
    """`typical` of a per-step-end reading's increments after the warm-up, the rank with most."""
    def of(readings: list) -> float:
        return typical([b - a for a, b in zip(readings, readings[1:])][WARMUP:])
    return max(of(r[key]) for r in result["ranks"])


def step_time(result: dict, typical=statistics.median) -> float:
    """Seconds between optimizer steps after the warm-up, the slowest rank's."""
    return per_step(result, "step_ends", typical)


def page_faults(result: dict) -> float:
    """Pages faulted in per step (minor faults), a count, not a clock."""
    return per_step(result, "minflt")


def peak(result: dict) -> int:
    return max(r["max_allocated"] or r["peak_rss_bytes"] for r in result["ranks"])


def overlap(result: dict, steps: int) -> float:
    """Milliseconds a step of CPU the process used while it waited for its turn (its other
    threads' work, done during the other program's step), the rank with most."""
    return max(r.get("cpu_while_waiting_s", 0.0) for r in result["ranks"]) * 1000 / steps


def losses_agree(bt: dict, plain: dict) -> bool:
    """Every loss blocktrain logged equals the plain loop's of that step, bitwise."""
    return bool(bt["losses"]) and all(plain["losses"].get(s) == v for s, v in bt["losses"].items())


def timing_rows(pairs: list[tuple[str, str]], a, out: str) -> dict:
    rounds: dict = {pair: [] for pair in pairs}
    for r in range(a.repeat):
        for model, policy in pairs:
            sides = ("bt", "plain") if r % 2 == 0 else ("plain", "bt")
            where = os.path.join(out, str(r))
            got = (run_turns(sides, model, policy, a, where) if a.interleave == "steps" else
                   {s: run(s, model, policy, a, where, True) for s in sides})
            rounds[model, policy].append({
                "ratio": step_time(got["bt"]) / step_time(got["plain"]),
                # Other load only ever adds time: the fastest steps are the least disturbed.
                "fastest": step_time(got["bt"], min) / step_time(got["plain"], min),
                "faults": (page_faults(got["bt"]), page_faults(got["plain"])),
                "step_s": step_time(got["plain"]), "peak": peak(got["bt"]) / peak(got["plain"]),
                "startup": (got["bt"]["startup_s"], got["plain"]["startup_s"]),
                "overlap": (overlap(got["bt"], a.steps), overlap(got["plain"], a.steps)),
                "equal": losses_agree(got["bt"], got["plain"])})
    return rounds


def totals(interval: dict, kind: str) -> collections.Counter:
    """An interval's counts of one kind by name (operators, host reads: without the site)."""
    counts: collections.Counter = collections.Counter()
    for key, n in interval[kind].items():
        counts[key.split(" @ ")[0] if kind in ("ops", "syncs") else key] += n
    return counts


def typical(result: dict) -> tuple[dict, dict]:
    """Rank 0's median interval by operator count (a step that is not logged), and its largest
    (the logged step's measurements)."""
    intervals = sorted(result["ranks"][0][WARMUP:], key=lambda i: sum(i["ops"].values()))
    return intervals[(len(intervals) - 1) // 2], intervals[-1]


def extras(bt: dict, plain: dict) -> dict[str, int]:
    """What blocktrain's step does more (> 0) or less (< 0) than the plain loop's, by name:
    operators and host reads by operator, hooks by what registered them."""
    found = {}
    for kind in ("ops", "syncs", "hooks"):
        diff = totals(bt, kind)
        diff.subtract(totals(plain, kind))
        diff.pop("aten._local_scalar_dense.default", None)  # each is a host read ("item")
        found.update({(k if kind != "hooks" else "hook " + k): n
                      for k, n in diff.items() if n})
    if totals(bt, "syncs")["item"] + totals(bt, "syncs")["tolist"] == totals(
            plain, "syncs")["item"] + totals(plain, "syncs")["tolist"]:
        found.pop("item", None), found.pop("tolist", None)  # as many reads, another method
    return found


def unnamed(found: dict[str, int]) -> dict[str, int]:
    """Extras NAMED_EXTRAS does not name, or names fewer of."""
    return {k: n for k, n in found.items() if n > NAMED_EXTRAS.get(k, (0, ""))[0]}


def count_row(model: str, policy: str, a, out: str) -> dict:
    bt, plain = (run(s, model, policy, a, out, False) for s in ("bt", "plain"))
    (bt_step, bt_logged), (plain_step, _) = typical(bt), typical(plain)
    per = {kind: (sum(bt_step[kind].values()), sum(plain_step[kind].values()))
           for kind in ("ops", "hooks", "syncs", "calls")}
    found = extras(bt_step, plain_step)
    return {"per_step": per, "extras": found, "unnamed": unnamed(found),
            "logged_extra_ops": sum(bt_logged["ops"].values()) - per["ops"][0],
            "logged_extra_hooks": sum(bt_logged["hooks"].values()) - per["hooks"][0]}


def describe(found: dict[str, int]) -> str:
    if not found:
        return "none"
    return ", ".join(f"{n:+d} {k}" for k, n in sorted(found.items(), key=lambda kv: -kv[1]))


def print_tables(timed: dict, counted: dict, a) -> None:
    print("| model | policy | step time x plain: median (range) | fastest step x plain: median "
          "(range) | plain step s | peak memory in training x plain | page faults a step: "
          "blocktrain / plain | launch to first step s: blocktrain / plain | CPU ms a step "
          "while waiting its turn: blocktrain / plain | losses bitwise equal |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for (model, policy), rounds in timed.items():
        ratios, fastest = [r["ratio"] for r in rounds], [r["fastest"] for r in rounds]
        bt_s, plain_s = (statistics.median(r["startup"][i] for r in rounds) for i in (0, 1))
        print(f"| {model} | {policy} | {statistics.median(ratios):.3f} ({min(ratios):.3f}-"
              f"{max(ratios):.3f}) | {statistics.median(fastest):.3f} ({min(fastest):.3f}-"
              f"{max(fastest):.3f}) | {statistics.median(r['step_s'] for r in rounds):.3f} | "
              f"{statistics.median(r['peak'] for r in rounds):.3f} | "
              f"{statistics.median(r['faults'][0] for r in rounds):.0f} / "
              f"{statistics.median(r['faults'][1] for r in rounds):.0f} | {bt_s:.1f} / "
              f"{plain_s:.1f} | {statistics.median(r['overlap'][0] for r in rounds):.1f} / "
              f"{statistics.median(r['overlap'][1] for r in rounds):.1f} | "
              f"{'yes' if all(r['equal'] for r in rounds) else 'NO'} |")
    if counted:
        print_counts(counted)


def print_counts(counted: dict) -> None:
    print("\n| model | policy | ops/step: blocktrain / plain | hooks | host reads | Python calls "
          "| logged step: + ops, + hooks | blocktrain's extras (unlogged step) |")
    print("|---|---|---|---|---|---|---|---|")
    for (model, policy), row in counted.items():
        cells = " | ".join(f"{b} / {p}" for b, p in row["per_step"].values())
        flag = f" **unnamed: {row['unnamed']}**" if row["unnamed"] else ""
        print(f"| {model} | {policy} | {cells} | +{row['logged_extra_ops']}, "
              f"+{row['logged_extra_hooks']} | {describe(row['extras'])}{flag} |")
    named = sorted({k for row in counted.values() for k, n in row["extras"].items()
                    if n > 0 and k in NAMED_EXTRAS})
    print("\nWhy blocktrain has them (NAMED_EXTRAS; the most a step may have):")
    for key in named:
        print(f"- {key} (<= {NAMED_EXTRAS[key][0]}): {NAMED_EXTRAS[key][1]}")


def load_average() -> str:
    try:
        return " / ".join(f"{x:.1f}" for x in os.getloadavg())
    except OSError:
        return "?"


def main(argv: Optional[list[str]] = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--nproc", type=int, default=2)
    p.add_argument("--repeat", type=int, default=3, help="timed rounds (0: counts only)")
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--policies", default="none,full,selective")
    p.add_argument("--models", default="llama,hf")
    p.add_argument("--micro-batch", type=int, default=8)
    p.add_argument("--seq", type=int, default=256)
    p.add_argument("--dropout", type=float, default=0.0, help="the Llama's (HF's: its config)")
    p.add_argument("--layers", type=int, default=4,
                   help="blocks of both models (the issue's own first measurement had 8)")
    p.add_argument("--device", default="cpu")
    p.add_argument("--malloc", choices=("default", "fixed"), default="default",
                   help="glibc's mmap/trim thresholds fixed in both processes, or its defaults")
    p.add_argument("--control", action="store_true",
                   help="the plain loop on both sides: what this machine reads for two equal "
                        "programs (the instrument's spread), no counts")
    p.add_argument("--overrides", default="",
                   help="more Hydra overrides for blocktrain's runs, space-separated (what "
                        "does a part of the loop cost: e.g. data.workers=0)")
    p.add_argument("--interleave", choices=("steps", "runs"), default="steps",
                   help="steps: both programs at once, taking turns a step each (a slow spell "
                        "of the machine falls on both); runs: one whole run after the other")
    a = p.parse_args(argv)
    if a.steps < WARMUP + 3:
        p.error(f"--steps must be >= {WARMUP + 3}: {WARMUP} step intervals are not measured")
    pairs = [(m, pol) for m in a.models.split(",") for pol in a.policies.split(",")]
    started = load_average()
    with tempfile.TemporaryDirectory() as out:
        timed = timing_rows(pairs, a, out) if a.repeat else {}
        counted = {} if a.control else {
            pair: count_row(*pair, a, os.path.join(out, "counts")) for pair in pairs}
    import torch

    print(f"# {datetime.date.today()} {platform.machine()} {os.cpu_count()} cores, load average "
          f"{started} at the start, {load_average()} at the end; torch {torch.__version__}; "
          f"python -m launch.bench --reference --nproc {a.nproc} --repeat {a.repeat} "
          f"--steps {a.steps} --policies {a.policies} --models {a.models} --micro-batch "
          f"{a.micro_batch} --seq {a.seq} --dropout {a.dropout} --device {a.device} --malloc "
          f"{a.malloc} --interleave {a.interleave} --layers {a.layers}"
          f"{' --control' if a.control else ''}"
          + (f" --overrides '{a.overrides}'" if a.overrides else ""))
    print_tables(timed, counted, a)
    return 1 if any(row["unnamed"] for row in counted.values()) else 0


if __name__ == "__main__":
    sys.exit(main())
