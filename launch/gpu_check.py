"""The GPU proof in one command: every CUDA path run, measured and compared, under a time cap.

    python -m launch.gpu_check --fetch-wheels .whl           # here, with package access
    python3 -m launch.gpu_check --wheels .whl --out OUT      # on the GPU host, offline
    python3 -m launch.gpu_check --wheels .whl --out OUT2 --resume OUT/gpu_check.json \
        --stages bench,predict --budget-s S                  # a second call: the rows left
    python -m launch.gpu_check --cpu-smoke --out OUT         # the same stages, tiny, on CPU

Stages, in order, each in its own process with its own time cap, so a failing or overrunning
stage is recorded and the next one still runs: `env`, `cuda_tests`, `parity` (every recompute
policy x offload none/cpu against `none`, and selective in bf16 against `none` in bf16), `fit` (the largest micro-batch under `full`, from the
memory model), `bench` (llama_1b in bf16 through the real trainer, and as the plain-PyTorch
launch/bench/plain.py), `torchtitan` and `predict` (the report's peak per row against the
measured high-water mark); README's "GPU check" has the details. A GPU session has ~15 minutes
of device time and one call may run 10 minutes: the default budget ends the first call inside
that, and `--resume` measures in a second call what the first had no time for. Results go to
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
from launch.cluster_env import DEFAULTS as CLUSTER_DEFAULTS
from launch.gpu_bench import ROWS, common_overrides, stage_bench, tail

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
GIB = 2 ** 30
ALLOC_CONF = "PYTORCH_CUDA_ALLOC_CONF"


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
    row_min_s: int = 0  # a benchmark row is not started with less of the budget left
    long_max: Optional[int] = None  # the long row's longest length (None: what fits)
    max_micro_batch: int = 64  # the largest micro-batch the fit stage tries

    @property
    def reference_shape(self) -> list[str]:
        """launch/bench/plain.py flags for the same shapes as `model`."""
        keys = {"model.dim": "--dim", "model.n_layers": "--layers", "model.n_heads": "--heads",
                "model.n_kv_heads": "--kv-heads", "model.ffn_hidden": "--ffn",
                "model.vocab_size": "--vocab"}
        pairs = [o.partition("=")[::2] for o in self.model]
        return [flag for key, value in pairs if key in keys for flag in (keys[key], value)]


LLAMA_1B = ["model=llama_1b"]  # launch/bench/plain.py's defaults are these shapes
TINY = ["model=tiny", "model.dim=64", "model.n_layers=4", "model.n_heads=4", "model.n_kv_heads=2",
        "model.ffn_hidden=128", "model.vocab_size=256"]

# Planned on an H200: ~1.5 s per llama_1b step at 16 x 4096 tokens, ~15 s of start-up per
# trainer process (so ~25-45 s a row), ~60 s of compile for a compiled row; env, CUDA tests,
# parity and fit ~150 s. The bench cap is the whole default budget: the budget binds, not it.
GPU = Mode("cuda", LLAMA_1B, "4096,2048", steps=6, warmup=2, parity_seq=256,
           caps={"env": 60, "cuda_tests": 150, "parity": 150, "fit": 90, "bench": 560,
                 "torchtitan": 30, "predict": 60}, row_cap=90, row_min_s=30)
# One device call may run 600 s: the check's own budget, wheels and start-up included, leaves
# 40 s for the interpreter's exit and the files' return.
GPU_BUDGET_S = 560.0
# On CPU the compile row uses aot_eager: inductor's C++ build costs ~30 s here and is covered by
# the test suite; the smoke run is about the stages, not the compiler. Its caps stop a runaway:
# ~80 s in all on an idle 2-core machine, but the test suite runs it beside other tests. Micro-
# batches up to 8: the nominal 16 GiB would take 64, 4,096 tokens a step, ~1 s each on 2 cores
# for 13 rows (the bench stage 100 s of the smoke run's 152 s, 256 s beside the suite).
CPU_SMOKE = Mode("cpu", TINY, "64", steps=3, warmup=1, parity_seq=32,
                 caps={"env": 120, "cuda_tests": 120, "parity": 240, "fit": 120, "bench": 400,
                       "torchtitan": 30, "predict": 120}, row_cap=120,
                 extra=["train.compile_backend=aot_eager"], long_max=2048, max_micro_batch=8)


class Check:
    """Runs stages, keeps every result, writes them after each stage."""

    def __init__(self, mode: Mode, out: str, work: str, env: dict,
                 budget_s: float = float("inf"), previous: Optional[dict] = None) -> None:
        self.mode, self.out, self.work, self.env = mode, out, work, env
        self.deadline = time.monotonic() + budget_s  # no stage starts or runs past it
        self.previous = previous or {}  # --resume: an earlier call's gpu_check.json
        self.result: dict = {"started": time.strftime("%Y-%m-%d %H:%M:%S %Z"), "stages": {},
                             "mode": "cpu-smoke" if mode.device == "cpu" else "gpu", "seconds": {}}
        os.makedirs(out, exist_ok=True)
        # A run directory's metrics.jsonl is appended to (bench rows clear their own, so that
        # --resume keeps the plan.json of the rows it keeps).
        shutil.rmtree(os.path.join(work, "parity"), ignore_errors=True)
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

    def keep(self, name: str) -> bool:
        """--resume: take an earlier call's stage if it was ok and is not one that goes on
        (bench measures the rows still missing; predict covers every row measured so far)."""
        earlier = self.previous.get("stages", {}).get(name)
        if name in RESUMED or not (earlier and earlier.get("ok")):
            return False
        self.result["stages"][name] = earlier
        self.result["seconds"][name] = 0.0
        print(f"[gpu_check] {name}: ok, kept from --resume", flush=True)
        return True

    def save(self) -> None:
        with open(os.path.join(self.out, "gpu_check.json"), "w") as f:
            json.dump(self.result, f, indent=1)

    def json_stage(self, args: list[str], cap: float, env: Optional[dict] = None) -> dict:
        """`python -m launch.gpu_stages ...`: its last output line is the JSON result."""
        status, output = self.run([sys.executable, "-m", "launch.gpu_stages", *args], cap, env)
        last = output.strip().splitlines()[-1] if output.strip() else ""
        if status != 0 or not last.startswith("{"):
            return {"ok": False, "error": f"exit status {status}: {tail(output)}"}
        return json.loads(last)


def _text(data) -> str:
    return data.decode(errors="replace") if isinstance(data, bytes) else (data or "")


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
    if "No module named pytest" in output:
        return {"ok": False, "exit_status": status, "error": (
            "pytest is not installed on this host: run `python -m launch.gpu_check "
            "--fetch-wheels DIR` where there is package access (it carries pytest, pluggy and "
            "iniconfig with the other wheels) and pass --wheels DIR here")}
    counts = gpu_table.junit_counts(report) if os.path.exists(report) else {}
    # pytest's status 5 is "no tests ran": every CUDA test skipped on a machine without one.
    ok = status == 0 or (status == 5 and check.mode.device == "cpu")
    if status == 0 and check.mode.device == "cuda" and counts.get("skipped"):
        ok = False  # on a GPU a skipped CUDA test is a test that did not run
    return {"ok": ok and status != 124, "exit_status": status, "files": files, **counts,
            **({} if ok else {"error": tail(output, 6)})}


def stage_parity(check: Check, cap: float) -> dict:
    env = dict(check.env, CUBLAS_WORKSPACE_CONFIG=":4096:8")  # cuBLAS without split-K atomics
    return check.json_stage(["parity", "--device", check.mode.device, "--work",
                             os.path.join(check.work, "parity"), "--seq-len",
                             str(check.mode.parity_seq)], cap, env)


def stage_fit(check: Check, cap: float) -> dict:
    env_info = check.result["stages"].get("env", {})
    capacity = env_info.get("total_memory") or 16 * GIB  # CPU smoke: a nominal 16 GiB device
    # Off the GPU: the memory model runs on meta tensors and must not take device memory.
    env = dict(check.env, CUDA_VISIBLE_DEVICES="")
    rows = os.path.join(check.work, "fit_rows.json")
    with open(rows, "w") as f:
        json.dump({n: o for n, o in ROWS.items() if not n.startswith("ref:")}, f)
    fit = check.json_stage(["fit", "--device", check.mode.device, "--capacity", str(capacity),
                            "--seq-lens", check.mode.seq_lens, "--rows", rows,
                            "--max-micro-batch", str(check.mode.max_micro_batch),
                            *(["--long-max", str(check.mode.long_max)]
                              if check.mode.long_max else []), "--",
                            *[o for o in common_overrides(check.mode)
                              if not o.startswith("train.device")]], cap, env)
    if "tried" in fit:
        fit["ok"] = fit["micro_batch"] is not None
        if not fit["ok"]:
            fit["error"] = "not even micro-batch 1 fits under full at any sequence length"
    return fit


def stage_torchtitan(check: Check, cap: float) -> dict:
    status, output = check.run([sys.executable, "-c", "import torchtitan, importlib.metadata as m;"
                                " print(m.version('torchtitan'))"], cap)
    if status != 0:
        return {"ok": True, "ran": False, "reason": gpu_table.TORCHTITAN_NOT_RUN
                + f" (import torchtitan: {tail(output, 1)})"}
    return {"ok": True, "ran": False, "version": output.strip().splitlines()[-1],
            "reason": "torchtitan imports, but its trainer needs a tokenizer and a dataset that "
                      "its wheel does not carry; no offline configuration of it is prepared"}


def stage_predict(check: Check, cap: float) -> dict:
    rows = check.result["stages"].get("bench", {}).get("rows", {})
    wanted = [{"name": n, "overrides": r["overrides"], "plan_json": r.get("plan_json")}
              for n, r in rows.items() if r.get("ok") and "overrides" in r]
    if not wanted and rows and all("skipped" in r for r in rows.values()):
        return {"ok": True, "skipped": "no benchmark row measured yet (no time for any)"}
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


RESUMED = ("bench", "predict")  # stages that go on from an earlier call's results
STAGES = {"env": stage_env, "cuda_tests": stage_cuda_tests, "parity": stage_parity,
          "fit": stage_fit, "bench": stage_bench, "torchtitan": stage_torchtitan,
          "predict": stage_predict}


def child_env(env: dict) -> dict:
    """What every stage's process runs with: the allocator settings of real runs (the Slurm
    script and `launch.cluster_env` export them), so fragmentation, the reserve figure and
    `auto` are measured as they will be used; a value already set here wins, as there."""
    out = dict(env)
    out.setdefault("WANDB_MODE", "disabled")
    out.setdefault(ALLOC_CONF, CLUSTER_DEFAULTS[ALLOC_CONF][0])
    return out


def parse_args(argv: Optional[list[str]]) -> argparse.Namespace:
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
                        help=f"seconds for the whole check; stages get what is left (default: "
                             f"{GPU_BUDGET_S:.0f} on a GPU, inside one 600 s device call; none "
                             "for --cpu-smoke)")
    parser.add_argument("--resume", metavar="JSON",
                        help="an earlier call's gpu_check.json: keep its stages that were ok "
                             "and its measured rows; bench runs only the rows it skipped")
    parser.add_argument("--stages", default=",".join(STAGES),
                        help="comma-separated subset of " + ",".join(STAGES))
    return parser.parse_args(argv)


def main(argv: Optional[list[str]] = None) -> int:
    args = parse_args(argv)
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
        previous = _load_previous(args.resume) if args.resume else {}
        installed = wheels.install(args.wheels, args.site) if args.wheels else []
    except RuntimeError as exc:  # names the flag and what to do
        print(f"error: {exc}", file=sys.stderr)
        return 2
    # The checkout first on every child's path (no build step); the wheels' folder before it.
    env = child_env(wheels.use(args.site, REPO) if args.wheels else wheels.use(REPO, REPO))
    mode = CPU_SMOKE if args.cpu_smoke else GPU
    budget = args.budget_s if args.budget_s is not None else (
        float("inf") if args.cpu_smoke else GPU_BUDGET_S)
    check = Check(mode, args.out, args.work, env, budget - (time.monotonic() - started),
                  previous)
    check.result.update(wheels_installed=installed, resumed_from=args.resume)
    # An earlier call's other stages stay in the report (fit and env are what bench needs).
    check.result["stages"].update(previous.get("stages", {}))
    check.result["seconds"].update({k: 0.0 for k in previous.get("stages", {})})
    for name in args.stages.split(","):
        if not check.keep(name):
            check.stage(name, lambda cap, body=STAGES[name]: body(check, cap))
    check.result["total_seconds"] = round(time.monotonic() - started, 1)
    check.result["ok"] = all(s.get("ok") for s in check.result["stages"].values())
    check.save()
    _report(check, args.out)
    return 0 if check.result["ok"] else 1


def _load_previous(path: str) -> dict:
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, ValueError) as exc:
        raise RuntimeError(f"--resume {path}: cannot read it ({exc}); give the gpu_check.json "
                           "an earlier call wrote") from exc


def _report(check: Check, out: str) -> None:
    markdown = gpu_table.markdown(check.result)
    with open(os.path.join(out, "gpu_check.md"), "w") as f:
        f.write(markdown)
    print(markdown)
    long_line = gpu_table.long_row_line(check.result)
    if long_line is not None:  # issue 44's check of the long-sequence prediction, on its own
        print(f"[gpu_check] {long_line}")
    print(f"[gpu_check] wrote {os.path.join(out, 'gpu_check.json')} and gpu_check.md; "
          "time per stage: " + ", ".join(f"{k} {v:.0f} s" for k, v in
                                         check.result["seconds"].items())
          + f"; total {check.result['total_seconds']:.0f} s")
    skipped = check.result["stages"].get("bench", {}).get("skipped")
    if skipped:
        print(f"[gpu_check] {len(skipped)} bench rows had no time ({', '.join(skipped)}): "
              f"measure them in another call with --resume "
              f"{os.path.join(out, 'gpu_check.json')} --stages bench,predict")


if __name__ == "__main__":
    sys.exit(main())
