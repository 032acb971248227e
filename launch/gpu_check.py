"""The GPU proof in one command: every CUDA path run, measured and compared, under a time cap.

    python -m launch.gpu_check --fetch-wheels .whl           # here, with package access
    python3 -m launch.gpu_check --wheels .whl --out OUT      # on the GPU host, offline
    python -m launch.gpu_check --cpu-smoke --out OUT         # the same stages, tiny, on CPU

Stages, in order, each in its own process with its own time cap, so a failing or overrunning
stage is recorded and the next one still runs: `env`, `cuda_tests`, `parity` (every recompute
policy x offload none/cpu against `none`), `fit` (the largest micro-batch under `full`, from the
memory model), `bench` (llama_1b in bf16 through the real trainer, and as the plain-PyTorch
launch/gpu_reference.py), `torchtitan` and `predict` (the report's peak per row against the
measured high-water mark); README's "GPU check" has the details. Results go to
OUT/gpu_check.json after every stage and OUT/gpu_check.md at the end. Standard library only: a
broken torch or a missing package is a failed stage, not a traceback before anything ran.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from typing import Callable, Optional

from launch import gpu_table, wheels

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
GIB = 2 ** 30


@dataclass(frozen=True)
class Mode:
    """What differs between the real check and the CPU smoke run of the same stages."""
    device: str
    model: list[str]  # overrides that set the benchmarked model's shapes
    seq_lens: str
    steps: int
    warmup: int  # first steps left out of the throughput figures
    parity_seq: int
    caps: dict  # stage -> seconds
    row_cap: int  # seconds per benchmark row
    extra: list[str] = field(default_factory=list)  # overrides for every benchmark row

    @property
    def reference_shape(self) -> list[str]:
        """gpu_reference.py flags for the same shapes as `model`."""
        keys = {"model.dim": "--dim", "model.n_layers": "--layers", "model.n_heads": "--heads",
                "model.n_kv_heads": "--kv-heads", "model.ffn_hidden": "--ffn",
                "model.vocab_size": "--vocab"}
        pairs = [o.partition("=")[::2] for o in self.model]
        return [flag for key, value in pairs if key in keys for flag in (keys[key], value)]


LLAMA_1B = ["model=llama_1b"]  # gpu_reference.py's defaults are these shapes
TINY = ["model=tiny", "model.dim=64", "model.n_layers=4", "model.n_heads=4", "model.n_kv_heads=2",
        "model.ffn_hidden=128", "model.vocab_size=256"]

# Planned on an H200 at ~7 minutes in all: ~1.5 s per llama_1b step at 16 x 4096 tokens, ~15 s
# of start-up per trainer process, ~60 s of compile for the compiled row.
GPU = Mode("cuda", LLAMA_1B, "4096,2048", steps=6, warmup=2, parity_seq=256,
           caps={"env": 60, "cuda_tests": 150, "parity": 120, "fit": 90, "bench": 360,
                 "torchtitan": 30, "predict": 60}, row_cap=90)
# On CPU the compile row uses aot_eager: inductor's C++ build costs ~30 s here and is covered by
# the test suite; the smoke run is about the stages, not the compiler. Its caps stop a runaway:
# ~80 s in all on an idle 2-core machine, but the test suite runs it beside other tests.
CPU_SMOKE = Mode("cpu", TINY, "64", steps=3, warmup=1, parity_seq=32,
                 caps={"env": 120, "cuda_tests": 120, "parity": 240, "fit": 120, "bench": 400,
                       "torchtitan": 30, "predict": 120}, row_cap=120,
                 extra=["train.compile_backend=aot_eager"])

# name -> overrides on top of the common ones; "ref:" rows run gpu_reference.py instead. In the
# order they run: the rows the targets need first, so a spent cap costs the least.
ROWS = {
    "selective": ["checkpointing=selective"],
    "ref:selective": [],
    "full": ["checkpointing=full"],
    "ref:full": [],
    "full + offload=cpu": ["checkpointing=full", "offload=cpu"],
    "none": ["checkpointing=none"],
    "budget": ["checkpointing=budget"],
    # The fastest plan predicted to fit the device less train.memory_reserve_gib (issue 14).
    "auto": ["checkpointing=auto"],
    "full + sharding.cpu_offload": ["checkpointing=full", "sharding.cpu_offload=true"],
    # Compiling is the slowest part (identical blocks share one graph); the compiler's own
    # placement last, beside ours: only where time is left.
    "selective + compile": ["checkpointing=selective", "train.compile=true"],
    "compiler": ["checkpointing=compiler"],
}
SLOW_ROWS = {"selective + compile": 2.0, "compiler": 2.0}  # row cap multiplier
AFTER_BENCH_S = 45  # what torchtitan and predict need of the budget (predict: ~15 s on a GPU host)


class Check:
    """Runs stages, keeps every result, writes them after each stage."""

    def __init__(self, mode: Mode, out: str, work: str, env: dict,
                 budget_s: float = float("inf")) -> None:
        self.mode, self.out, self.work, self.env = mode, out, work, env
        self.deadline = time.monotonic() + budget_s  # no stage starts or runs past it
        self.result: dict = {"started": time.strftime("%Y-%m-%d %H:%M:%S %Z"), "stages": {},
                             "mode": "cpu-smoke" if mode.device == "cpu" else "gpu", "seconds": {}}
        os.makedirs(out, exist_ok=True)
        for folder in ("parity", "bench"):  # a run directory's metrics.jsonl is appended to
            shutil.rmtree(os.path.join(work, folder), ignore_errors=True)
        os.makedirs(work, exist_ok=True)
        self.log = open(os.path.join(out, "gpu_check.log"), "w", buffering=1)

    def run(self, argv: list[str], cap: float, env: Optional[dict] = None) -> tuple[int, str]:
        """A child process under a time cap; (exit status or 124, its output). Its standard
        output comes last, so a JSON result printed there is the last line."""
        self.log.write(f"$ {' '.join(argv)}\n")
        try:
            done = subprocess.run(argv, cwd=REPO, env=env or self.env, capture_output=True,
                                  text=True, timeout=max(1.0, cap))
            output, status = done.stderr + done.stdout, done.returncode
        except subprocess.TimeoutExpired as exc:
            output = (_text(exc.stderr) + _text(exc.stdout)
                      + f"\n[stopped at its cap of {cap:.0f} s]")
            status = 124
        self.log.write(output + "\n")
        return status, output

    def stage(self, name: str, body: Callable[[float], dict]) -> Optional[dict]:
        started = time.monotonic()
        left = self.deadline - started
        print(f"[gpu_check] {name} ...", flush=True)
        try:
            if left < 5:
                raise TimeoutError("not run: the check's time budget (--budget-s) was spent")
            outcome = body(min(float(self.mode.caps[name]), left))
        except Exception as exc:  # recorded; the next stage still runs
            outcome = {"ok": False, "error": f"{type(exc).__name__}: {exc}"}
        seconds = time.monotonic() - started
        self.result["stages"][name] = outcome
        self.result["seconds"][name] = round(seconds, 1)
        print(f"[gpu_check] {name}: {'ok' if outcome.get('ok') else 'FAILED'} in {seconds:.0f} s"
              + (f" ({outcome['error']})" if outcome.get("error") else ""), flush=True)
        self.save()
        return outcome

    def save(self) -> None:
        with open(os.path.join(self.out, "gpu_check.json"), "w") as f:
            json.dump(self.result, f, indent=1)

    def json_stage(self, args: list[str], cap: float, env: Optional[dict] = None) -> dict:
        """`python -m launch.gpu_stages ...`: its last output line is the JSON result."""
        status, output = self.run([sys.executable, "-m", "launch.gpu_stages", *args], cap, env)
        last = output.strip().splitlines()[-1] if output.strip() else ""
        if status != 0 or not last.startswith("{"):
            return {"ok": False, "error": f"exit status {status}: {_tail(output)}"}
        return json.loads(last)


def _text(data) -> str:
    return data.decode(errors="replace") if isinstance(data, bytes) else (data or "")


def _tail(output: str, lines: int = 3) -> str:
    return " | ".join(line.strip() for line in output.strip().splitlines()[-lines:])


def stage_env(check: Check, cap: float) -> dict:
    info = check.json_stage(["env"], cap)
    if "torch" in info:
        missing = info["torch_api"]["missing"]
        info["ok"] = not missing and (info["cuda"] or check.mode.device == "cpu")
        if missing:
            info["error"] = (f"torch {info['torch']} lacks {len(missing)} API(s) the project "
                             f"uses: " + ", ".join(f"{k} ({v})" for k, v in missing.items()))
        elif not info["ok"]:
            info["error"] = "no CUDA device visible (use --cpu-smoke on a machine without one)"
    return info


def cuda_test_files() -> list[str]:
    """The test files holding CUDA-marked tests. Only these are collected: the GPU host lacks
    some packages other test files import (wandb), and a collection error would stop pytest."""
    folder = os.path.join(REPO, "tests")
    found = []
    for name in sorted(os.listdir(folder)):
        if name.startswith("test_") and name.endswith(".py"):
            with open(os.path.join(folder, name)) as f:
                if "@pytest.mark.cuda" in f.read():
                    found.append(os.path.join("tests", name))
    return found


def stage_cuda_tests(check: Check, cap: float) -> dict:
    report = os.path.join(check.work, "cuda_tests.xml")
    files = cuda_test_files()
    status, output = check.run([sys.executable, "-m", "pytest", "-q", "-m", "cuda", "-p",
                                "no:cacheprovider", f"--junitxml={report}", *files], cap)
    counts = gpu_table.junit_counts(report) if os.path.exists(report) else {}
    # pytest's status 5 is "no tests ran": every CUDA test skipped on a machine without one.
    ok = status == 0 or (status == 5 and check.mode.device == "cpu")
    if status == 0 and check.mode.device == "cuda" and counts.get("skipped"):
        ok = False  # on a GPU a skipped CUDA test is a test that did not run
    return {"ok": ok and status != 124, "exit_status": status, "files": files, **counts,
            **({} if ok else {"error": _tail(output, 6)})}


def stage_parity(check: Check, cap: float) -> dict:
    env = dict(check.env, CUBLAS_WORKSPACE_CONFIG=":4096:8")  # cuBLAS without split-K atomics
    return check.json_stage(["parity", "--device", check.mode.device, "--work",
                             os.path.join(check.work, "parity"), "--seq-len",
                             str(check.mode.parity_seq)], cap, env)


def common_overrides(mode: Mode) -> list[str]:
    return [*mode.model, "data=synthetic", "sharding.param_dtype=bfloat16",
            "sharding.reduce_dtype=float32", f"train.device={mode.device}", *mode.extra]


def stage_fit(check: Check, cap: float) -> dict:
    env_info = check.result["stages"].get("env", {})
    capacity = env_info.get("total_memory") or 16 * GIB  # CPU smoke: a nominal 16 GiB device
    # Off the GPU: the memory model runs on meta tensors and must not take device memory.
    env = dict(check.env, CUDA_VISIBLE_DEVICES="")
    rows = os.path.join(check.work, "fit_rows.json")
    with open(rows, "w") as f:
        json.dump({n: o for n, o in ROWS.items() if not n.startswith("ref:")}, f)
    fit = check.json_stage(["fit", "--device", check.mode.device, "--capacity", str(capacity),
                            "--seq-lens", check.mode.seq_lens, "--rows", rows, "--",
                            *[o for o in common_overrides(check.mode)
                              if not o.startswith("train.device")]], cap, env)
    if "tried" in fit:
        fit["ok"] = fit["micro_batch"] is not None
        if not fit["ok"]:
            fit["error"] = "not even micro-batch 1 fits under full at any sequence length"
    return fit


def row_overrides(check: Check, name: str, micro_batch: int, seq_len: int) -> list[str]:
    m = check.mode
    # auto: on a GPU it fits the device less train.memory_reserve_gib; the CPU has no default.
    memory = ([f"train.memory_gib={check.result['stages']['fit']['capacity'] / 2 ** 30:.6f}"]
              if "checkpointing=auto" in ROWS[name] and m.device == "cpu" else [])
    return [*common_overrides(m), *ROWS[name], *memory, f"data.seq_len={seq_len}",
            f"train.micro_batch_size={micro_batch}", f"train.steps={m.steps}", "logging.every=1",
            "logging.wandb=false", "logging.progress=false", f"train.eval_every={m.steps}",
            "train.eval_batches=1", "save.at_end=false", "save.every=0", "save.resume=false"]


def bench_row(check: Check, name: str, micro_batch: int, seq_len: int, cap: float) -> dict:
    """One row at this micro-batch; out of memory: once more at half of it."""
    m = check.mode
    run_dir = os.path.join(check.work, "bench", name.replace(" ", "").replace(":", "_")
                           .replace("+", "_").replace("=", "-"))
    if name.startswith("ref:"):
        argv = [sys.executable, "-m", "launch.gpu_reference", "--policy", name[4:],
                "--micro-batch", str(micro_batch), "--seq", str(seq_len), "--steps",
                str(m.steps), "--warmup", str(m.warmup), "--device", m.device,
                *m.reference_shape]
    else:
        overrides = row_overrides(check, name, micro_batch, seq_len)
        argv = [sys.executable, "-m", "trainer", *overrides, f"hydra.run.dir={run_dir}"]
    status, output = check.run(argv, cap)
    if status != 0 and "out of memory" in output.lower() and micro_batch > 1:
        row = bench_row(check, name, micro_batch // 2, seq_len, cap)
        row["note"] = f"out of memory at micro-batch {micro_batch}; halved"
        return row
    if status != 0:
        return {"ok": False, "micro_batch": micro_batch,
                "error": f"exit status {status}: {_tail(output)}"}
    if name.startswith("ref:"):
        measured = gpu_table.reference_figures(json.loads(output.strip().splitlines()[-1]))
    else:
        measured = gpu_table.trainer_figures(os.path.join(run_dir, "metrics.jsonl"), m.warmup)
        measured["overrides"] = overrides
        measured["plan_json"] = os.path.join(run_dir, "plan.json")
    return {"ok": True, "micro_batch": micro_batch, "seq_len": seq_len, **measured}


def stage_bench(check: Check, cap: float) -> dict:
    fit = check.result["stages"].get("fit", {})
    if not fit.get("micro_batch"):
        return {"ok": False, "error": "no micro-batch from the fit stage"}
    # The stages after it (torchtitan, predict) keep their share of the check's budget.
    deadline = min(time.monotonic() + cap, check.deadline - AFTER_BENCH_S)
    rows = {}
    for name in ROWS:
        left = deadline - time.monotonic()
        if left < 5:
            rows[name] = {"ok": False, "error": "not run: the bench stage's cap was spent"}
            continue
        # A reference row runs at the micro-batch of blocktrain's row for the same policy.
        micro_batch = fit["row_micro_batch"].get(name.removeprefix("ref:"), fit["micro_batch"])
        rows[name] = bench_row(check, name, micro_batch, fit["seq_len"],
                               min(check.mode.row_cap * SLOW_ROWS.get(name, 1.0), left))
        check.result["stages"]["bench"] = {"rows": rows}  # kept even if a later row hangs
        check.save()
    return {"ok": all(r["ok"] for r in rows.values()), "rows": rows,
            "micro_batch": fit["micro_batch"], "seq_len": fit["seq_len"],
            "peak_flops_note": "MFU uses the dense bf16 peak of trainer/observe/metrics.py's table"}


def stage_torchtitan(check: Check, cap: float) -> dict:
    status, output = check.run([sys.executable, "-c", "import torchtitan, importlib.metadata as m;"
                                " print(m.version('torchtitan'))"], cap)
    if status != 0:
        return {"ok": True, "ran": False, "reason": gpu_table.TORCHTITAN_NOT_RUN
                + f" (import torchtitan: {_tail(output, 1)})"}
    return {"ok": True, "ran": False, "version": output.strip().splitlines()[-1],
            "reason": "torchtitan imports, but its trainer needs a tokenizer and a dataset that "
                      "its wheel does not carry; no offline configuration of it is prepared"}


def stage_predict(check: Check, cap: float) -> dict:
    rows = check.result["stages"].get("bench", {}).get("rows", {})
    wanted = [{"name": n, "overrides": r["overrides"], "plan_json": r.get("plan_json")}
              for n, r in rows.items() if r.get("ok") and "overrides" in r]
    if not wanted:
        return {"ok": False, "error": "no benchmark row to predict"}
    path = os.path.join(check.work, "predict_rows.json")
    with open(path, "w") as f:
        json.dump(wanted, f)
    env = dict(check.env, CUDA_VISIBLE_DEVICES="")
    predicted = check.json_stage(["predict", "--device", check.mode.device, "--rows", path],
                                 cap, env)
    if "error" in predicted and "ok" in predicted:
        return predicted
    comparison = gpu_table.compare_predictions(predicted, rows, check.mode.device)
    return {"ok": all("error" not in p for p in predicted.values()), "rows": comparison}


STAGES = {"env": stage_env, "cuda_tests": stage_cuda_tests, "parity": stage_parity,
          "fit": stage_fit, "bench": stage_bench, "torchtitan": stage_torchtitan,
          "predict": stage_predict}


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="gpu_check_out", help="folder for gpu_check.json/.md")
    parser.add_argument("--work", default=os.path.join(tempfile.gettempdir(),
                                                       "blocktrain-gpu-check"),
                        help="folder for the runs' directories (kept out of --out: many files)")
    parser.add_argument("--cpu-smoke", action="store_true",
                        help="the same stages on a tiny model on the CPU (what CI runs)")
    parser.add_argument("--fetch-wheels", metavar="DIR",
                        help="download the wheels the GPU host lacks into DIR, then exit")
    parser.add_argument("--python-version", default="3.12", help="the GPU host's Python")
    parser.add_argument("--wheels", metavar="DIR", help="install DIR's wheels offline first")
    parser.add_argument("--site", default="/tmp/blocktrain-gpu-site",
                        help="private folder the --wheels are installed into")
    parser.add_argument("--budget-s", type=float, default=None,
                        help="seconds for the whole check; stages get what is left (default: "
                             "470 on a GPU, so it ends inside 8 minutes; none for --cpu-smoke)")
    parser.add_argument("--stages", default=",".join(STAGES),
                        help="comma-separated subset of " + ",".join(STAGES))
    args = parser.parse_args(argv)
    unknown = set(args.stages.split(",")) - set(STAGES)
    if unknown:
        print(f"error: --stages: unknown {', '.join(sorted(unknown))}; choose from "
              + ", ".join(STAGES), file=sys.stderr)
        return 2
    started = time.monotonic()
    try:
        if args.fetch_wheels:
            found = wheels.fetch(args.fetch_wheels, args.python_version)
            print(f"{len(found)} wheels in {args.fetch_wheels}: "
                  + ", ".join(os.path.basename(w) for w in found))
            return 0
        installed = wheels.install(args.wheels, args.site) if args.wheels else []
    except RuntimeError as exc:  # names the flag and what to do
        print(f"error: {exc}", file=sys.stderr)
        return 2
    # The checkout first on every child's path (no build step); the wheels' folder before it.
    env = wheels.use(args.site, REPO) if args.wheels else wheels.use(REPO, REPO)
    env.setdefault("WANDB_MODE", "disabled")
    mode = CPU_SMOKE if args.cpu_smoke else GPU
    budget = args.budget_s if args.budget_s is not None else (
        float("inf") if args.cpu_smoke else 470.0)
    check = Check(mode, args.out, args.work, env, budget - (time.monotonic() - started))
    check.result["wheels_installed"] = installed
    for name in args.stages.split(","):
        check.stage(name, lambda cap, body=STAGES[name]: body(check, cap))
    check.result["total_seconds"] = round(time.monotonic() - started, 1)
    check.result["ok"] = all(s.get("ok") for s in check.result["stages"].values())
    check.save()
    markdown = gpu_table.markdown(check.result)
    with open(os.path.join(args.out, "gpu_check.md"), "w") as f:
        f.write(markdown)
    print(markdown)
    print(f"[gpu_check] wrote {os.path.join(args.out, 'gpu_check.json')} and gpu_check.md; "
          "time per stage: " + ", ".join(f"{k} {v:.0f} s" for k, v in
                                         check.result["seconds"].items())
          + f"; total {check.result['total_seconds']:.0f} s")
    return 0 if check.result["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
