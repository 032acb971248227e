"""The GPU check's `bench` stage: llama_1b through the real trainer and the plain reference.

Rows run in order of value under what is left of the check's budget. A row there is no time for
is reported as skipped, not as a failure, and a later call with `--resume` measures only the
rows still missing: the first GPU session has ~15 minutes of device time, and one call to it may
run 10 minutes, so the check is planned as two calls (README, "GPU check"). Standard library
only, like launch/gpu_check.py.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import time
from typing import TYPE_CHECKING

from launch import gpu_table

if TYPE_CHECKING:
    from launch.gpu_check import Check, Mode

LONG_ROW = "long: tiles + offload + chunked"
# name -> overrides on top of the common ones; "ref:" rows run launch/bench/plain.py instead.
# In order of value, since the budget may end the list early: first what the targets need
# (G1: selective and its reference; G2: full and full + offload=cpu; auto against the uniform
# policies that ran: selective and full already, then none), then the other policies and the
# second reference, and last the compiled rows: compiling costs the most device time (identical
# blocks share one graph, still ~60 s) and no target depends on them.
ROWS = {
    "selective": ["checkpointing=selective"],
    "ref:selective": [],
    "full": ["checkpointing=full"],
    "full + offload=cpu": ["checkpointing=full", "offload=cpu"],
    # The fastest plan predicted to fit the device less train.memory_reserve_gib (issue 14).
    "auto": ["checkpointing=auto"],
    "none": ["checkpointing=none"],
    # The fused chunked loss head against the plain one (issue 26): the peak and tokens/s.
    "full + head=chunked": ["checkpointing=full", "checkpointing.head=chunked"],
    # Issue 38: the longest sequence the report says fits (fit stage's "long"), micro-batch 1,
    # every block recomputed and its input offloaded, in sequence tiles, the chunked head.
    LONG_ROW: ["checkpointing=full", "offload=cpu", "checkpointing.head=chunked",
               "checkpointing.tiles=16"],
    "budget": ["checkpointing=budget"],
    "ref:full": [],
    "full + sharding.cpu_offload": ["checkpointing=full", "sharding.cpu_offload=true"],
    "selective + compile": ["checkpointing=selective", "train.compile=true"],
    "compiler": ["checkpointing=compiler"],
}
SLOW_ROWS = {"selective + compile": 2.0, "compiler": 2.0}  # multiplies a row's cap and minimum
GIB = 2 ** 30
AFTER_BENCH_S = 45  # what torchtitan and predict need of the budget (predict: ~15 s on a GPU host)


def tail(output: str, lines: int = 3) -> str:
    return " | ".join(line.strip() for line in output.strip().splitlines()[-lines:])


def common_overrides(mode: Mode) -> list[str]:
    return [*mode.model, "data=synthetic", "sharding.param_dtype=bfloat16",
            "sharding.reduce_dtype=float32", f"train.device={mode.device}", *mode.extra]


def row_overrides(check: Check, name: str, micro_batch: int, seq_len: int) -> list[str]:
    m = check.mode
    # auto: on a GPU it fits the device less train.memory_reserve_gib; the CPU has no default.
    memory = ([f"train.memory_gib={check.result['stages']['fit']['capacity'] / 2 ** 30:.6f}"]
              if "checkpointing=auto" in ROWS[name] and m.device == "cpu" else [])
    if name == LONG_ROW:  # its pinned pool holds what it offloads; the model takes the length
        long = check.result["stages"]["fit"]["long"]
        memory += [f"model.max_seq_len={seq_len}",
                   f"offload.max_host_bytes={max(GIB, -(-long['host_activations'] // GIB) * GIB)}"]
    return [*common_overrides(m), *ROWS[name], *memory, f"data.seq_len={seq_len}",
            f"train.micro_batch_size={micro_batch}", f"train.steps={m.steps}", "logging.every=1",
            "logging.wandb=false", "logging.progress=false", f"train.eval_every={m.steps}",
            "train.eval_batches=1", "save.at_end=false", "save.every=0", "save.resume=false"]


def bench_row(check: Check, name: str, micro_batch: int, seq_len: int, cap: float) -> dict:
    """One row at this micro-batch; out of memory: once more at half of it, in what is left of
    `cap`."""
    m = check.mode
    started = time.monotonic()
    run_dir = os.path.join(check.work, "bench", name.replace(" ", "").replace(":", "_")
                           .replace("+", "_").replace("=", "-"))
    if name.startswith("ref:"):
        argv = [sys.executable, "-m", "launch.bench.plain", "--policy", name[4:],
                "--micro-batch", str(micro_batch), "--seq", str(seq_len), "--steps",
                str(m.steps), "--warmup", str(m.warmup), "--device", m.device,
                *m.reference_shape]
    else:
        overrides = row_overrides(check, name, micro_batch, seq_len)
        argv = [sys.executable, "-m", "trainer", *overrides, f"hydra.run.dir={run_dir}"]
        shutil.rmtree(run_dir, ignore_errors=True)  # its metrics.jsonl would be appended to
    status, output = check.run(argv, cap)
    left = cap - (time.monotonic() - started)
    if status != 0 and "out of memory" in output.lower() and micro_batch > 1 and left >= 1:
        row = bench_row(check, name, micro_batch // 2, seq_len, left)
        row["note"] = f"out of memory at micro-batch {micro_batch}; halved"
        return row
    if status != 0:
        return {"ok": False, "micro_batch": micro_batch, "exit_status": status,
                "error": f"exit status {status}: {tail(output)}"}
    if name.startswith("ref:"):
        measured = gpu_table.reference_figures(json.loads(output.strip().splitlines()[-1]))
    else:
        measured = gpu_table.trainer_figures(os.path.join(run_dir, "metrics.jsonl"), m.warmup)
        measured["overrides"] = overrides
        measured["plan_json"] = os.path.join(run_dir, "plan.json")
    return {"ok": True, "micro_batch": micro_batch, "seq_len": seq_len, **measured}


def planned_micro_batch(fit: dict, rows: dict, name: str) -> int:
    """A trainer row: the fit stage's micro-batch for it. A reference row: the one its trainer
    row finally ran at (halved there after running out of memory), so that the pair compares
    the same work; the planned one if the trainer row has no figures."""
    policy = name.removeprefix("ref:")
    trainer_row = rows.get(policy, {})
    if name.startswith("ref:") and trainer_row.get("ok"):
        return trainer_row["micro_batch"]
    return fit["row_micro_batch"].get(policy, fit["micro_batch"])


def _run_or_skip(check: Check, name: str, fit: dict, rows: dict, deadline: float) -> dict:
    """The row, or why there was no time for it: less left than it needs, or the budget ended
    while it ran. Neither is a failure of the row."""
    scale = SLOW_ROWS.get(name, 1.0)
    left = deadline - time.monotonic()
    need = max(5.0, check.mode.row_min_s * scale)
    if left < need:
        return {"skipped": f"not run: {max(0.0, left):.0f} s of the budget left, the row needs "
                           f"~{need:.0f} s; measure it with --resume"}
    cap = check.mode.row_cap * scale
    micro_batch, seq_len = planned_micro_batch(fit, rows, name), fit["seq_len"]
    if name == LONG_ROW:
        if not fit.get("long", {}).get("seq_len"):
            return {"ok": False, "error": f"no length from the fit stage: {fit.get('long')}"}
        micro_batch, seq_len = 1, fit["long"]["seq_len"]
    row = bench_row(check, name, micro_batch, seq_len, min(cap, left))
    if row.get("exit_status") == 124 and left < cap:
        return {"skipped": f"stopped when the check's budget (--budget-s) ran out, after "
                           f"{left:.0f} s; measure it with --resume",
                "micro_batch": row["micro_batch"]}
    return row


def stage_bench(check: Check, cap: float) -> dict:
    fit = check.result["stages"].get("fit", {})
    if not fit.get("micro_batch"):
        return {"ok": False, "error": "no micro-batch from the fit stage"}
    # The stages after it (torchtitan, predict) keep their share of the check's budget.
    deadline = min(time.monotonic() + cap, check.deadline - AFTER_BENCH_S)
    # --resume: rows an earlier call measured (or that failed there) are kept as they are.
    earlier = check.previous.get("stages", {}).get("bench", {}).get("rows", {})
    rows: dict = {}
    for name in ROWS:
        if name in earlier and "skipped" not in earlier[name]:
            rows[name] = earlier[name]
            continue
        rows[name] = _run_or_skip(check, name, fit, rows, deadline)
        check.result["stages"]["bench"] = {"rows": rows}  # kept even if a later row hangs
        check.save()
    # Rows there was no time for are not failures: a later call measures them (--resume).
    return {"ok": all(r["ok"] for r in rows.values() if "skipped" not in r), "rows": rows,
            "skipped": [n for n, r in rows.items() if "skipped" in r],
            "micro_batch": fit["micro_batch"], "seq_len": fit["seq_len"],
            "peak_flops_note": "MFU uses the dense bf16 peak of trainer/observe/metrics.py's table"}
