"""The GPU check's stages that need torch, each run by launch/gpu_check.py as its own process.

    python -m launch.gpu_stages env
    python -m launch.gpu_stages parity --device cuda --work DIR
    python -m launch.gpu_stages fit --device cuda --capacity BYTES -- <trainer overrides>
    python -m launch.gpu_stages predict --device cuda --rows ROWS.json

Each prints one JSON object as its last line of output. A stage in its own process can be
stopped at its time cap, and a crash in one (a CUDA error, an out-of-memory) costs that stage
only.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
from typing import Optional, Sequence

PARITY_POLICIES = ("none", "full", "every_k", "sqrt", "selective", "budget")
PARITY_TARGETS = ("none", "cpu")
PARITY_BF16 = ("selective",)  # also run with bf16 parameters, against `none` in bf16
BF16 = ["sharding.param_dtype=bfloat16", "sharding.reduce_dtype=float32"]
GIB = 2 ** 30


def env_stage() -> dict:
    """What this host is, and whether its torch has every API the project uses."""
    import platform

    import torch

    from launch.torch_api import check

    info = {"python": platform.python_version(), "torch": torch.__version__,
            "cpu_count": os.cpu_count(), "cuda": torch.cuda.is_available(),
            "torch_api": check(),
            # The allocator the figures are measured under (launch/gpu_check.py sets it).
            "alloc_conf": os.environ.get("PYTORCH_CUDA_ALLOC_CONF")}
    for name in ("hydra-core", "omegaconf", "pytest", "transformers", "wandb"):
        try:
            from importlib import metadata

            info[name] = metadata.version(name)
        except Exception:
            info[name] = None
    # sharding.cpu_offload's optimizer step runs on this host's CPU: the report's nominal rate
    # (trainer/preflight/scenario.py) against this host's, all cores and one.
    from launch.bench.host_adamw import step_seconds

    numel = 64_000_000
    info["host_adamw_ns_per_element"] = {
        threads: round(step_seconds(numel, 16_000_000, threads, 3) / numel * 1e9, 3)
        for threads in sorted({1, os.cpu_count() or 1})}
    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        info.update(device=props.name, total_memory=props.total_memory,
                    capability=f"{props.major}.{props.minor}", device_count=torch.cuda.device_count(),
                    cuda_runtime=torch.version.cuda, cudnn=torch.backends.cudnn.version(),
                    nccl=".".join(map(str, torch.cuda.nccl.version())))
    return info


def _run_logged(overrides: Sequence[str], run_dir: str) -> list[dict]:
    """One trainer run in this process (the process group is kept for the next one, as a `-m`
    sweep does); returns its logged steps."""
    from trainer.cli import check
    from trainer.loop import train

    cfg, layout = check([*overrides, f"hydra.run.dir={run_dir}"], {"WORLD_SIZE": "1"})
    os.makedirs(run_dir, exist_ok=True)
    status = train(cfg, layout, run_dir, keep_process_group=True)
    if status:
        raise RuntimeError(f"{run_dir}: the run stopped early with status {status}")
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        return [m for m in map(json.loads, f) if "loss" in m]


def parity_overrides(device: str, seq_len: int) -> list[str]:
    """A small model with dropout on: every policy must reproduce `none`'s losses."""
    return ["model=tiny", "model.dropout=0.1", "data=synthetic", f"data.seq_len={seq_len}",
            "train.micro_batch_size=4", "train.steps=4", f"train.device={device}",
            "logging.every=1", "logging.wandb=false", "logging.progress=false",
            "train.eval_every=4", "train.eval_batches=1", "save.at_end=false", "save.every=0",
            "save.resume=false", "offload.min_bytes=0"]


def parity_stage(device: str, work: str, seq_len: int) -> dict:
    """Every recompute policy x offload none/cpu against `none`, 4 steps; `none` twice first to
    learn whether this device's kernels repeat bit for bit. Then selective in bf16 against a
    bf16 `none` (also run twice): only there does a GPU's attention take a fused kernel that
    draws its dropout mask inside the op selective checkpointing keeps (fp32 with grouped
    heads takes the math path, where dropout is an op of its own)."""
    import torch

    from trainer.distenv import shutdown

    if device == "cuda":
        # Deterministic kernels where CUDA has them (attention's backward adds with atomics
        # otherwise): a baseline that repeats bit for bit holds every policy to bitwise.
        torch.use_deterministic_algorithms(True, warn_only=True)
    base = parity_overrides(device, seq_len)
    runs: dict[str, list[dict]] = {}
    keys = ([("none", "none", "again", [])]
            + [(p, t, "", []) for p in PARITY_POLICIES for t in PARITY_TARGETS]
            + [(p, "none", tag, BF16) for p, tag in (("none", "bf16"), ("none", "bf16-again"),
                                                     *((p, "bf16") for p in PARITY_BF16))])
    try:
        for policy, target, tag, extra in keys:
            name = "-".join(filter(None, (policy, target, tag)))
            runs[name] = _run_logged([*base, *extra, f"checkpointing={policy}",
                                      f"offload={target}"], os.path.join(work, name))
    finally:
        shutdown()
    fp32 = _judge({n: r for n, r in runs.items() if "bf16" not in n}, "none-none",
                  "none-none-again")
    bf16 = _judge({n: r for n, r in runs.items() if "bf16" in n}, "none-none-bf16",
                  "none-none-bf16-again")
    rows = fp32.pop("rows") + bf16.pop("rows")
    # On a GPU the cpu target must actually have moved something, or the test proves nothing.
    moved = all(r["offloaded_bytes"] > 0 for r in rows if "-cpu" in r["run"])
    return {"device": device, **fp32, "bf16": bf16, "rows": rows, "offload_moved": moved,
            "ok": all(r["ok"] for r in rows) and (moved or device == "cpu")}


def _judge(runs: dict[str, list[dict]], reference_name: str, repeat_name: str) -> dict:
    """Each run's losses against the reference run's, within the reference's own repeat."""
    reference = [m["loss"] for m in runs[reference_name]]
    repeat = [m["loss"] for m in runs[repeat_name]]
    deterministic = repeat == reference
    spread = _max_rel(repeat, reference)
    # Where the baseline itself does not repeat bit for bit (atomics in some CUDA backward
    # kernels), a policy can only be held to the baseline's own run-to-run noise.
    tolerance = 0.0 if deterministic else max(1e-5, 10 * spread)
    rows = []
    for name, logged in runs.items():
        losses = [m["loss"] for m in logged]
        diff = _max_rel(losses, reference)
        rows.append({"run": name, "losses": losses, "bitwise": losses == reference,
                     "max_rel_diff": diff, "ok": diff <= tolerance,
                     "offloaded_bytes": max((m.get("offloaded_bytes", 0) for m in logged),
                                            default=0),
                     "act_saved_bytes": max(m["act_saved_bytes"] for m in logged)})
    return {"deterministic_baseline": deterministic, "baseline_spread": spread,
            "tolerance": tolerance, "rows": rows}


def _max_rel(values: Sequence[float], reference: Sequence[float]) -> float:
    if len(values) != len(reference):
        return float("inf")
    return max((abs(v - r) / max(abs(r), 1e-12) for v, r in zip(values, reference)), default=0.0)


def _evaluator(device: str):
    from trainer.preflight.tables import DEFAULT_TFLOPS
    from trainer.preflight.scenario import Evaluator

    # As the report: on a GPU AdamW takes its foreach path (one group-sized temporary).
    return Evaluator(DEFAULT_TFLOPS, optimizer_foreach=device != "cpu")


def _scenario(overrides: Sequence[str]):
    from trainer.preflight.scenario import Scenario
    from trainer.cli import check

    cfg, layout = check(list(overrides), {"WORLD_SIZE": "1"}, local_gpus=False)
    return Scenario(cfg, layout, 1)


def fit_stage(device: str, capacity: int, overrides: Sequence[str], seq_lens: Sequence[int],
              max_micro_batch: int, headroom: float, rows: dict[str, list[str]],
              long_max: Optional[int] = None) -> dict:
    """The largest power-of-two micro-batch whose predicted peak under `full` fits `capacity`
    x `headroom` (the rest is left for what the memory model does not count: CUDA context,
    NCCL buffers, fragmentation), at the first sequence length where one fits; then for each
    benchmark row (policy overrides) that micro-batch, halved until the row is predicted to fit,
    so no device time is spent on a run that cannot fit."""
    evaluator = _evaluator(device)
    found = _largest_fitting(evaluator, overrides, seq_lens, max_micro_batch,
                             capacity * headroom)
    from launch.gpu_bench import LONG_ROW

    if LONG_ROW in rows:
        found["long"] = long_fit(evaluator, [*overrides, *rows[LONG_ROW]], capacity * headroom,
                                 long_max)
    model = _scenario(overrides).cfg.model
    found.update(capacity=capacity, headroom=headroom, model_dim=model.dim,
                 model_layers=model.n_layers)
    if found["micro_batch"] is None:
        return found
    found["row_micro_batch"], found["row_predicted_peak"] = {}, {}
    for name, extra in rows.items():
        micro_batch = found["micro_batch"]
        if name == LONG_ROW:  # micro-batch 1 at its own length (found["long"])
            found["row_micro_batch"][name] = 1
            continue
        if "checkpointing=auto" in extra:  # fits itself (train.memory_gib: the device less reserve)
            found["row_micro_batch"][name] = micro_batch
            continue
        while True:
            peak = evaluator.evaluate(_scenario(
                [*overrides, *extra, f"data.seq_len={found['seq_len']}",
                 f"train.micro_batch_size={micro_batch}"])).estimate.peak.total
            if peak <= capacity * headroom or micro_batch == 1:
                break
            micro_batch //= 2
        found["row_micro_batch"][name] = micro_batch
        found["row_predicted_peak"][name] = peak
    return found


def long_fit(evaluator, overrides: Sequence[str], limit: float,
             long_max: Optional[int] = None) -> dict:
    """The longest data.seq_len (micro-batch 1, multiples of 1024) whose predicted peak is
    within `limit`, as `python -m trainer.report --longest` finds it; at most `long_max`."""
    from trainer.preflight.longest import longest

    def predict(scenario):
        if long_max is not None and scenario.cfg.data.seq_len > long_max:
            return False, None, None
        outcome = evaluator.evaluate(scenario)
        return outcome.estimate.peak.total <= limit, outcome, None

    try:
        found = longest(_scenario([*overrides, "train.micro_batch_size=1"]), predict)
    except Exception as exc:  # none fits, or the config is refused: the row says why
        return {"seq_len": None, "error": f"{type(exc).__name__}: {exc}"}
    est = found.outcome.estimate
    return {"seq_len": found.seq_len, "predicted_peak": est.peak.total, "phase": est.peak.name,
            "host_activations": est.host_activations, "tried": [list(t) for t in found.tried]}


def _largest_fitting(evaluator, overrides: Sequence[str], seq_lens: Sequence[int],
                     max_micro_batch: int, limit: float) -> dict:
    tried = []
    for seq_len in seq_lens:
        best = None
        micro_batch = 1
        while micro_batch <= max_micro_batch:
            scenario = _scenario([*overrides, "checkpointing=full", f"data.seq_len={seq_len}",
                                  f"train.micro_batch_size={micro_batch}"])
            peak = evaluator.evaluate(scenario).estimate.peak.total
            fits = peak <= limit
            tried.append({"seq_len": seq_len, "micro_batch": micro_batch, "predicted_peak": peak,
                          "fits": fits})
            if not fits:
                break
            best = micro_batch
            micro_batch *= 2
        if best is not None:
            return {"seq_len": seq_len, "micro_batch": best, "tried": tried}
    return {"seq_len": None, "micro_batch": None, "tried": tried}


def predict_stage(device: str, rows: Sequence[dict]) -> dict:
    """The report's predicted peak for each benchmarked configuration, with the plan the
    trainer actually carried out (its plan.json) where there is one: the budget planner's
    choice on the device can differ from the one the report derives from FLOPs."""
    from checkpointing.plan import plan_from_json

    evaluator = _evaluator(device)
    out = {}
    for row in rows:
        try:
            scenario = _scenario(row["overrides"])
            plan, source = None, "report"
            plan_path = row.get("plan_json")
            if plan_path and os.path.exists(plan_path):
                with open(plan_path) as f:
                    plan, source = plan_from_json(f.read()), "trainer plan.json"
            outcome = evaluator.evaluate(scenario, plan)
            est = outcome.estimate
            out[row["name"]] = {"predicted_peak": est.peak.total, "phase": est.peak.name,
                                "activation_peak": est.activation_peak, "plan_from": source,
                                # kept outside the blocks (embedding, final norm, loss head)
                                "rest_bytes": outcome.profile.rest_bytes}
        except Exception as exc:  # one row's failure must not cost the others
            out[row["name"]] = {"error": f"{type(exc).__name__}: {exc}"}
    return out


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("stage", choices=("env", "parity", "fit", "predict"))
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--work", default="/tmp/blocktrain-gpu-check")
    parser.add_argument("--seq-len", type=int, default=256, help="parity: sequence length")
    parser.add_argument("--capacity", type=int, default=0, help="fit: device bytes")
    parser.add_argument("--seq-lens", default="4096,2048", help="fit: sequence lengths to try")
    parser.add_argument("--max-micro-batch", type=int, default=64)
    parser.add_argument("--headroom", type=float, default=0.9)
    parser.add_argument("--long-max", type=int, default=None,
                        help="fit: the longest length the long row may take")
    parser.add_argument("--rows", help="fit: JSON file of {name: overrides}; predict: of "
                                       "[{name, overrides, plan_json}]")
    argv = list(sys.argv[1:] if argv is None else argv)
    cut = argv.index("--") if "--" in argv else len(argv)
    args = parser.parse_args(argv[:cut])
    args.overrides = argv[cut + 1:]  # the trainer's overrides, after "--"
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr)
    if args.stage == "env":
        result = env_stage()
    elif args.stage == "parity":
        result = parity_stage(args.device, args.work, args.seq_len)
    elif args.stage == "fit":
        rows = {}
        if args.rows:
            with open(args.rows) as f:
                rows = json.load(f)
        result = fit_stage(args.device, args.capacity, args.overrides,
                           [int(s) for s in args.seq_lens.split(",")], args.max_micro_batch,
                           args.headroom, rows, args.long_max)
    else:
        with open(args.rows) as f:
            result = predict_stage(args.device, json.load(f))
    print(json.dumps(result), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
