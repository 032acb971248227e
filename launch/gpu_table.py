"""The GPU check's figures: read from runs, compared, judged against the targets, written out.

Standard library only, like launch/gpu_check.py, so a report is written whatever failed.
"""

from __future__ import annotations

import json
import statistics
import xml.etree.ElementTree as ElementTree
from typing import Optional

GIB = 2 ** 30

# Measured on 2026-11-30 (`pip download torchtitan==0.3.0` with its dependencies, CPython
# 3.11 wheels, x86-64): 78 wheels; those the GPU host lacks come to ~114 MiB (pyarrow 52 MiB,
# wandb 19 MiB, pandas 12 MiB, ...), while a device call carries 64 MiB in all.
TORCHTITAN_NOT_RUN = (
    "torchtitan 0.3.0 is not installed on this host: with its dependencies it needs ~114 MiB of "
    "wheels this host lacks (datasets with pyarrow and pandas, tensorboard, wandb, torchdata, "
    "torch_checkpointing, spmd_types, tyro), more than the 64 MiB a device call carries, and a "
    "tokenizer and dataset its wheel does not hold; no torchtitan figure this run")


def junit_counts(path: str) -> dict:
    """passed/failed/skipped/errors of a pytest --junitxml report."""
    root = ElementTree.parse(path).getroot()
    suites = [root] if root.tag == "testsuite" else list(root)
    total = {k: sum(int(s.get(k, 0)) for s in suites)
             for k in ("tests", "failures", "errors", "skipped")}
    total["passed"] = total["tests"] - total["failures"] - total["errors"] - total["skipped"]
    return total


def _spread(values: list[float]) -> float:
    """Step-time spread: (slowest - fastest) / median, over the timed steps."""
    if len(values) < 2:
        return 0.0
    return (max(values) - min(values)) / statistics.median(values)


def trainer_figures(metrics_path: str, warmup: int) -> dict:
    with open(metrics_path) as f:
        logged = [m for m in map(json.loads, f) if "loss" in m]
    timed = [m for m in logged if m["step"] > warmup] or logged
    mfu = [m["mfu"] for m in timed if "mfu" in m]
    return {
        "tokens_per_s": statistics.median(m["tokens_per_s"] for m in timed),
        "mfu": statistics.median(mfu) if mfu else None,
        "step_time_s": statistics.median(m["step_time_s"] for m in timed),
        "step_spread": _spread([m["step_time_s"] for m in timed]),
        "peak_mem_bytes": max(m["peak_mem_bytes"] for m in logged),
        "peak_reserved_bytes": max((m.get("peak_reserved_bytes") or 0 for m in logged),
                                   default=0) or None,
        "device_used_bytes": max((m.get("device_used_bytes") or 0 for m in logged),
                                 default=0) or None,
        "act_saved_bytes": max(m["act_saved_bytes"] for m in logged),
        "offloaded_bytes": max((m.get("offloaded_bytes", 0) for m in logged), default=0),
        "losses": [m["loss"] for m in logged],
    }


def reference_figures(result: dict) -> dict:
    timed = result["step_time_s"][len(result["step_time_s"]) - len(result["tokens_per_s"]):]
    return {
        "tokens_per_s": statistics.median(result["tokens_per_s"]),
        "mfu": None,
        "step_time_s": statistics.median(timed),
        "step_spread": _spread(timed),
        "peak_mem_bytes": result["max_memory_allocated"],
        "peak_reserved_bytes": result["max_memory_reserved"],
        "act_saved_bytes": None, "offloaded_bytes": None, "losses": result["losses"],
    }


def compare_predictions(predicted: dict, rows: dict, device: str) -> dict:
    """Predicted peak against the measured high-water mark (CUDA: max allocated). On CPU the
    measured figure is the process's RSS, which holds the interpreter and libraries too."""
    out = {}
    for name, p in predicted.items():
        measured = rows.get(name, {}).get("peak_mem_bytes")
        entry = dict(p)
        if "predicted_peak" in p and measured:
            entry["measured_peak"] = measured
            entry["ratio"] = p["predicted_peak"] / measured
            entry["within_10pct"] = abs(entry["ratio"] - 1) <= 0.10 if device == "cuda" else None
        out[name] = entry
    return out


LONG_ROW = "long: tiles + offload + chunked"  # launch/gpu_bench.py's (torch-free here)
LONG_TARGET = "long row: the report's predicted peak within 10% of max_memory_allocated"


def long_row_line(result: dict) -> Optional[str]:
    """The long row's measured max_memory_allocated against the report's prediction, as one
    line with the ratio (goal: within 10%); None when the long row has no comparison."""
    row = result["stages"].get("bench", {}).get("rows", {}).get(LONG_ROW, {})
    p = result["stages"].get("predict", {}).get("rows", {}).get(LONG_ROW, {})
    if "ratio" not in p:
        return None
    measured, predicted = p["measured_peak"], p["predicted_peak"]
    where = ("max_memory_allocated" if result.get("mode") == "gpu"
             else "peak RSS (CPU smoke: the process, not tensors)")
    return (f"long row ({row.get('seq_len', '?')} tokens, micro-batch "
            f"{row.get('micro_batch', '?')}): measured {where} {measured / GIB:.2f} GiB, "
            f"predicted {predicted / GIB:.2f} GiB, predicted/measured {p['ratio']:.3f} "
            f"({'within' if abs(p['ratio'] - 1) <= 0.10 else 'NOT within'} the 10% goal)")


def targets(result: dict) -> list[tuple[str, Optional[bool], str]]:
    """(target, met?, the figures) for G1, G2 and the prediction; None: no figure to judge."""
    bench = result["stages"].get("bench", {})
    rows = bench.get("rows", {})
    fit = result["stages"].get("fit", {})
    out = []
    sel, ref = rows.get("selective", {}), rows.get("ref:selective", {})
    if sel.get("ok") and ref.get("ok") and sel["micro_batch"] != ref["micro_batch"]:
        out.append(("G1: selective MFU >= 45%, >= 0.97x the plain reference", None,
                    f"not comparable: selective ran at micro-batch {sel['micro_batch']}, the "
                    f"reference at {ref['micro_batch']}"))
    elif sel.get("ok") and ref.get("ok") and sel.get("mfu") is not None:
        ratio = sel["tokens_per_s"] / ref["tokens_per_s"]
        out.append(("G1: selective MFU >= 45%, >= 0.97x the plain reference",
                    sel["mfu"] >= 0.45 and ratio >= 0.97,
                    f"MFU {sel['mfu']:.1%}, {ratio:.3f}x the reference's tokens/s"))
    else:
        out.append(("G1: selective MFU >= 45%, >= 0.97x the plain reference", None,
                    "no selective/reference pair with MFU (CPU, or a row failed)"))
    out.append(_g2(result, rows, fit))
    out.append(_head(rows))
    predicted = result["stages"].get("predict", {}).get("rows", {})
    beyond = {n: r["device_used_bytes"] - r["peak_mem_bytes"] for n, r in rows.items()
              if r.get("ok") and r.get("device_used_bytes") and not n.startswith("ref:")}
    if beyond:  # what train.memory_reserve_gib (default 4 GiB) must cover besides tensors
        worst = max(beyond, key=beyond.get)
        out.append(("train.memory_reserve_gib default (4 GiB) covers device used - max allocated",
                    beyond[worst] <= 4 * 2 ** 30,
                    f"largest {beyond[worst] / 2 ** 30:.2f} GiB ({worst}); CUDA context, NCCL, "
                    "allocator cache"))
    auto = rows.get("auto", {})
    if auto.get("ok") and result.get("mode") == "gpu":
        uniform = {n: rows[n]["tokens_per_s"] for n in ("none", "full", "selective")
                   if rows.get(n, {}).get("ok")}
        if uniform:
            best = max(uniform, key=uniform.get)
            out.append(("auto at least as fast as the fastest uniform policy that ran",
                        auto["tokens_per_s"] >= 0.98 * uniform[best],
                        f"auto {auto['tokens_per_s']:,.0f} tokens/s, {best} "
                        f"{uniform[best]:,.0f}"))
    long_line = long_row_line(result)
    if long_line is not None and result.get("mode") == "gpu":
        out.append((LONG_TARGET, abs(predicted[LONG_ROW]["ratio"] - 1) <= 0.10, long_line))
    ratios = {n: p["ratio"] for n, p in predicted.items() if "ratio" in p}
    if ratios and result.get("mode") == "gpu":
        worst = max(ratios, key=lambda n: abs(ratios[n] - 1))
        out.append(("report's predicted peak within 10% of max allocated, every row",
                    all(abs(r - 1) <= 0.10 for r in ratios.values()),
                    f"worst {worst}: predicted/measured {ratios[worst]:.3f}"))
    return out


def _head(rows: dict) -> tuple[str, Optional[bool], str]:
    """The chunked loss head (issue 26): a lower peak than the plain head at <= 1.03x its step
    time, both under `full` at the same micro-batch."""
    name = "chunked head: lower peak than plain, <= 1.03x its step time (full)"
    plain, chunked = rows.get("full", {}), rows.get("full + head=chunked", {})
    if not (plain.get("ok") and chunked.get("ok")):
        return name, None, "full or full + head=chunked did not run"
    if plain["micro_batch"] != chunked["micro_batch"]:
        return name, None, (f"not comparable: micro-batch {plain['micro_batch']} against "
                            f"{chunked['micro_batch']}")
    ratio = plain["tokens_per_s"] / chunked["tokens_per_s"]
    lower = chunked["peak_mem_bytes"] < plain["peak_mem_bytes"]
    return name, lower and ratio <= 1.03, (
        f"peak {chunked['peak_mem_bytes'] / 2**30:.2f} vs {plain['peak_mem_bytes'] / 2**30:.2f} "
        f"GiB, step time {ratio:.3f}x")


def _g2(result: dict, rows: dict, fit: dict) -> tuple[str, Optional[bool], str]:
    """G2 from the measured peaks: under `full` every block's input stays on the device until
    backward (n_layers of them at the loss head's peak), so what offload removed from max
    allocated, in block inputs, tells how many it left. Not from act_saved_bytes: that leaves
    out every moved tensor whether or not its memory was freed by then."""
    name = "G2: full + offload=cpu <= 3% slower than full, <= 2 block inputs on device"
    full, off = rows.get("full", {}), rows.get("full + offload=cpu", {})
    dim, layers = fit.get("model_dim"), fit.get("model_layers")
    if result.get("mode") != "gpu":
        return name, None, "nothing moves off a CPU compute device"
    if not (full.get("ok") and off.get("ok") and dim and layers):
        return name, None, "full, full + offload=cpu or the fit stage's shapes are missing"
    if (full["micro_batch"], full["seq_len"]) != (off["micro_batch"], off["seq_len"]):
        return name, None, (f"not comparable: full ran at micro-batch {full['micro_batch']}, "
                            f"with offload at {off['micro_batch']}")
    slower = full["tokens_per_s"] / off["tokens_per_s"] - 1
    block_input = off["micro_batch"] * off["seq_len"] * dim * 2  # bf16 hidden states
    kept = layers - (full["peak_mem_bytes"] - off["peak_mem_bytes"]) / block_input
    figures = f"{slower:+.1%} step time, {kept:.2f} block inputs kept (from max allocated"
    if full.get("peak_reserved_bytes") and off.get("peak_reserved_bytes"):
        # Shown, not judged: a freed block whose copy is still pending counts as reserved.
        freed = full["peak_reserved_bytes"] - off["peak_reserved_bytes"]
        by_reserved = layers - freed / block_input
        figures += f"; {by_reserved:.2f} from max reserved"
    return name, slower <= 0.03 and kept <= 2, figures + ")"


def _gib(value) -> str:
    return "" if value is None else f"{value / GIB:.2f}"


def markdown(result: dict) -> str:
    env = result["stages"].get("env", {})
    lines = [f"# GPU check, {result['started']} ({result['mode']})", "",
             f"{env.get('device', 'no GPU')}, torch {env.get('torch', '?')}, Python "
             f"{env.get('python', '?')}, CUDA {env.get('cuda_runtime', '-')}, "
             f"NCCL {env.get('nccl', '-')}, PYTORCH_CUDA_ALLOC_CONF "
             f"{env.get('alloc_conf') or 'unset'}; total {result.get('total_seconds', 0):.0f} s",
             *([f"resumed from {result['resumed_from']}"] if result.get("resumed_from") else []),
             "",
             "| stage | result | seconds | note |", "|---|---|---|---|"]
    for name, stage in result["stages"].items():
        note = stage.get("error") or stage.get("reason") or ""
        if name == "predict" and stage.get("skipped"):
            note = stage["skipped"]
        if name == "bench" and stage.get("skipped"):
            note = (f"{len(stage['skipped'])} of {len(stage['rows'])} rows had no time: "
                    "measure them with --resume")
        if name == "cuda_tests" and "tests" in stage:
            note = (f"{stage['passed']} passed, {stage['failures']} failed, {stage['errors']} "
                    f"errors, {stage['skipped']} skipped")
        if name == "parity" and "rows" in stage:
            note = (f"{len(stage['rows'])} runs; baseline repeats bit for bit: "
                    f"{stage['deterministic_baseline']}; tolerance {stage['tolerance']:g}; "
                    f"bitwise {sum(r['bitwise'] for r in stage['rows'])}/{len(stage['rows'])}"
                    + (f"; bf16 rows: baseline repeats {stage['bf16']['deterministic_baseline']}"
                       f", tolerance {stage['bf16']['tolerance']:g}" if "bf16" in stage else ""))
        if name == "fit" and stage.get("micro_batch"):
            note = f"micro-batch {stage['micro_batch']} x seq {stage['seq_len']} under full"
        lines.append(f"| {name} | {'ok' if stage.get('ok') else 'FAILED'} | "
                     f"{result['seconds'].get(name, 0):.0f} | {note.replace('|', '/')} |")
    rows = result["stages"].get("bench", {}).get("rows", {})
    predict = result["stages"].get("predict", {}).get("rows", {})
    if rows:
        lines += ["", "| row | micro-batch | tokens/s | MFU | x ref | max alloc GiB | reserved GiB "
                  "| act saved GiB | offloaded GiB | step spread | predicted GiB | pred/meas |",
                  "|---|---|---|---|---|---|---|---|---|---|---|---|"]
        for name, r in rows.items():
            if "skipped" in r:
                lines.append(f"| {name} | {r.get('micro_batch', '')} | skipped: "
                             f"{r['skipped'].replace('|', '/')} |||||||||||")
                continue
            if not r.get("ok"):
                lines.append(f"| {name} | {r.get('micro_batch', '')} | failed: "
                             f"{r.get('error', '')[:120].replace('|', '/')} |||||||||||")
                continue
            policy = name.split(" ")[0]
            ref = rows.get(f"ref:{policy}", {})
            # Only the same work compares: a row halved after running out of memory is not.
            x_ref = (f"{r['tokens_per_s'] / ref['tokens_per_s']:.3f}"
                     if ref.get("ok") and not name.startswith("ref:")
                     and ref["micro_batch"] == r["micro_batch"] else "")
            p = predict.get(name, {})
            lines.append(
                f"| {name} | {r['micro_batch']} | {r['tokens_per_s']:,.0f} | "
                f"{'' if r['mfu'] is None else format(r['mfu'], '.1%')} | {x_ref} | "
                f"{_gib(r['peak_mem_bytes'])} | {_gib(r['peak_reserved_bytes'])} | "
                f"{_gib(r['act_saved_bytes'])} | {_gib(r['offloaded_bytes'])} | "
                f"{r['step_spread']:.1%} | {_gib(p.get('predicted_peak'))} | "
                f"{format(p['ratio'], '.3f') if 'ratio' in p else ''} |")
    lines += ["", "| target | met | figures |", "|---|---|---|"]
    for name, met, figures in targets(result):
        lines.append(f"| {name} | {'n/a' if met is None else ('yes' if met else 'no')} | "
                     f"{figures} |")
    return "\n".join(lines) + "\n"
