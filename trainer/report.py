"""`python -m trainer.report [--world-size N] [--nodes M] [--gpu-memory-gib G] <overrides>`.

The pre-flight "will it fit" report: the trainer's plan for this config, every block's saved
bytes and recompute FLOPs, the per-rank memory of a step (see checkpointing/memory.py) and a
verdict against the GPU's memory, with the changes that would make it fit. Everything is
measured on the meta device, so it runs on a laptop for a 70B model in seconds. Writes
memory_plan.json and memory_plan.png to --out (default: a new <train.out_dir>/reports/<time>).
"""

from __future__ import annotations

import argparse
import json
import os
import time
import re
import sys
from dataclasses import asdict
from typing import Optional, Sequence

from trainer.cli import check, report
from trainer.config import ConfigError
from trainer.task import task_for

GIB = 2 ** 30
DEFAULT_TFLOPS = 400.0


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # one line and exit 2, like the trainer
        raise ConfigError("config", message)


def parse_args(argv: Sequence[str]) -> argparse.Namespace:
    parser = _Parser(prog="python -m trainer.report", description=__doc__)
    parser.add_argument("--world-size", type=int, default=1, help="ranks (GPUs) in the job")
    parser.add_argument("--nodes", type=int, default=1, help="nodes the ranks are spread over")
    parser.add_argument("--gpu-memory-gib", type=float, default=None,
                        help="memory per GPU for the verdict (default: the visible CUDA device; "
                             "none on CPU)")
    parser.add_argument("--tflops", type=float, default=DEFAULT_TFLOPS,
                        help="nominal FLOP/s per GPU (in TFLOP/s) for recompute seconds")
    parser.add_argument("--out", default=None, help="folder for memory_plan.{json,png}")
    parser.add_argument("overrides", nargs="*", help="the trainer's Hydra overrides")
    args = parser.parse_intermixed_args(list(argv))
    if args.world_size < 1:
        raise ConfigError("--world-size", f"must be a positive integer, got {args.world_size}")
    if args.nodes < 1 or args.world_size % args.nodes:
        raise ConfigError("--nodes", f"{args.nodes} must be positive and divide --world-size "
                          f"{args.world_size}")
    if args.gpu_memory_gib is not None and not args.gpu_memory_gib > 0:
        raise ConfigError("--gpu-memory-gib", f"must be > 0, got {args.gpu_memory_gib}")
    if not args.tflops > 0:
        raise ConfigError("--tflops", f"must be > 0, got {args.tflops}")
    return args


def output_dir(args: argparse.Namespace, cfg) -> str:
    """--out, else hydra.run.dir from the command line, else a folder of its own under
    <train.out_dir>/reports (not a run directory: no run is started)."""
    if args.out:
        return args.out
    for override in args.overrides:
        if override.startswith("hydra.run.dir="):
            return override.split("=", 1)[1]
    base = os.path.join(cfg.train.out_dir, "reports", time.strftime("%Y%m%d-%H%M%S"))
    out, n = base, 1
    while os.path.exists(out):
        n += 1
        out = f"{base}-{n}"
    return out


def capacity_bytes(args: argparse.Namespace, cfg) -> Optional[int]:
    from trainer.autofit import fitting

    """--gpu-memory-gib, else train.memory_gib, else the visible CUDA device (less
    train.memory_reserve_gib when fitting, as the trainer does)."""
    if args.gpu_memory_gib is not None:
        return int(args.gpu_memory_gib * GIB)
    if cfg.train.memory_gib is not None:
        return int(cfg.train.memory_gib * GIB)
    import torch

    if torch.cuda.is_available():
        reserve = int(cfg.train.memory_reserve_gib * GIB) if fitting(cfg) else 0
        return torch.cuda.get_device_properties(0).total_memory - reserve
    return None


def collapse(rows: Sequence[dict]) -> list[tuple[str, dict]]:
    """Consecutive rows with equal numbers become one, named like 'layers.0-79 x80'."""
    groups: list[list[dict]] = []
    for row in rows:
        key = (row["recompute"], row["saved_bytes"], row["recompute_flops"])
        if groups and (groups[-1][0]["recompute"], groups[-1][0]["saved_bytes"],
                       groups[-1][0]["recompute_flops"]) == key:
            groups[-1].append(row)
        else:
            groups.append([row])
    out = []
    for group in groups:
        first, last = group[0]["name"], group[-1]["name"]
        if len(group) == 1:
            out.append((first, group[0]))
            continue
        head = re.match(r"(.*?)(\d*)$", first).groups()
        tail = re.match(r"(.*?)(\d*)$", last).groups()
        span = (f"{head[0]}{head[1]}-{tail[1]}" if head[0] == tail[0] and head[1] and tail[1]
                else f"{first}..{last}")
        out.append((f"{span} x{len(group)}", group[0]))
    return out


def block_rows(outcome) -> list[dict]:
    est = outcome.estimate
    return [{"index": p.index, "name": p.name, "recompute": p.recompute,
             "saved_bytes": saved, "recompute_flops": flops,
             "working_set_bytes": measure.peak_bytes[p.recompute]}
            for p, saved, flops, measure in zip(outcome.plan, est.block_saved, est.block_flops,
                                                outcome.profile.blocks)]


def summary(outcome) -> dict:
    """Every number of one prediction, for memory_plan.json."""
    est, sc = outcome.estimate, outcome.scenario
    return {
        "world_size": sc.layout.world_size, "nodes": sc.layout.world_size // sc.gpus_per_node,
        "sharding": sc.cfg.sharding.mode, "shard": sc.layout.shard,
        "replicate": sc.layout.replicate, "grad_accum": sc.layout.grad_accum,
        "micro_batch_size": sc.cfg.train.micro_batch_size,
        "tokens_per_sample": task_for(sc.cfg.model, sc.cfg.data).tokens_per_sample,
        "param_dtype": sc.cfg.sharding.param_dtype, "policy": sc.cfg.checkpointing.policy,
        "per_rank_bytes": {"params": est.params, "grads": est.grads, "optimizer": est.optimizer,
                           "activation_peak": est.activation_peak,
                           "end_of_forward_activations": est.end_of_forward,
                           "no_checkpoint_activations": est.no_checkpoint,
                           "predicted_peak": est.peak.total},
        "peak_phase": {**asdict(est.peak), "total": est.peak.total},
        "phases": [{**asdict(p), "total": p.total} for p in est.phases],
        "recompute_flops_per_step": est.recompute_flops,
        "recompute_seconds_per_step": est.recompute_flops * outcome.seconds_per_flop,
        "host_bytes": est.host, "not_modeled": not_modeled(sc.cfg),
        "budget_bytes": outcome.budget.bytes if outcome.budget else None,
        "rest_bytes": outcome.profile.rest_bytes,
        "head": asdict(outcome.profile.head),
    }


def table(outcome, tflops: float) -> str:
    est, sc = outcome.estimate, outcome.scenario
    tokens = task_for(sc.cfg.model, sc.cfg.data).tokens_per_sample
    lines = [f"{'block':<22} {'option':<10} {'saved MiB':>11} {'recompute GFLOP':>16}"]
    for name, row in collapse(block_rows(outcome)):
        lines.append(f"{name:<22} {row['recompute']:<10} {row['saved_bytes'] / 2**20:>11.2f} "
                     f"{row['recompute_flops'] / 1e9:>16.1f}")
    peak = est.peak
    dtype = sc.cfg.sharding.param_dtype or "float32 (no mixed precision)"
    lines += [
        "",
        f"per rank: world {sc.layout.world_size} ({sc.cfg.sharding.mode}, shard "
        f"{sc.layout.shard} x replicate {sc.layout.replicate}), micro-batch "
        f"{sc.cfg.train.micro_batch_size} x {tokens} tokens, grad_accum "
        f"{sc.layout.grad_accum}, param dtype {dtype}",
        f"  {'parameters (this rank' + chr(39) + 's shard)':<39} {peak.params / GIB:>9.2f} GiB",
        f"  {'gradients (at the peak)':<39} {peak.grads / GIB:>9.2f} GiB"
        f"   ({(0 if est.host else est.grads) / GIB:.2f} after backward)",
        f"  {'optimizer (AdamW exp_avg, exp_avg_sq)':<39} {peak.optimizer / GIB:>9.2f} GiB",
        f"  {'unsharded params/grads, temporaries':<39} {peak.unsharded / GIB:>9.2f} GiB",
        f"  {'activations (then)':<39} {peak.activations / GIB:>9.2f} GiB"
        f"   (their own peak {est.activation_peak / GIB:.2f} GiB, in the forward/backward; end "
        f"of forward {est.end_of_forward / GIB:.2f}; no checkpointing "
        f"{est.no_checkpoint / GIB:.2f})",
        f"  {'predicted peak':<39} {peak.total / GIB:>9.2f} GiB   (during {peak.name}: the "
        "lines above are that moment's)",
        f"recompute: {est.recompute_flops / 1e12:.1f} TFLOP per step = "
        f"{est.recompute_flops * outcome.seconds_per_flop:.3f} s at a nominal {tflops:g} TFLOP/s "
        "per GPU (--tflops)",
    ]
    if est.host:
        lines.append(f"host memory (sharding.cpu_offload): parameters, gradients and optimizer "
                     f"state {est.host / GIB:.2f} GiB per rank, not on the GPU")
    for note in not_modeled(sc.cfg):
        lines.append(f"note: {note}")
    if outcome.budget is not None:
        lines.append(f"budget: {outcome.budget.bytes / GIB:.2f} GiB of activations per rank "
                     f"(no checkpointing: {outcome.budget.no_checkpoint_bytes / GIB:.2f} GiB)")
    return "\n".join(lines)


def not_modeled(cfg) -> list[str]:
    """Settings the memory model does not follow yet; the prediction is then an upper bound."""
    notes = []
    if cfg.offload.target != "none":
        notes.append(f"offload={cfg.offload.target}: offloaded blocks keep only their storages "
                     f"under offload.min_bytes on the device; the block fetched ahead in backward "
                     "is counted; the offload engine's own buffers are not")
    if cfg.checkpointing.policy == "compiler":
        notes.append("checkpointing=compiler: torch.compile's partitioner chooses what each "
                     "block keeps when it compiles; predicted as checkpointing=none, which keeps "
                     "the most (the run's act_saved_bytes measures what it kept)")
    elif cfg.train.compile:
        notes.append("train.compile=true is not modeled: compiled blocks may keep other "
                     "tensors than the eager ones measured here")
    return notes


def verdict(peak: int, capacity: Optional[int]) -> str:
    if capacity is None:
        return ("no verdict: pass --gpu-memory-gib (no CUDA device is visible); tensors only, "
                "leave headroom for the CUDA context, NCCL and fragmentation")
    if peak <= capacity:
        return (f"fits: predicted peak {peak / GIB:.2f} GiB of {capacity / GIB:.2f} GiB per GPU "
                f"({(capacity - peak) / GIB:.2f} GiB left for the CUDA context, NCCL and "
                "fragmentation)")
    return f"does NOT fit (needs {peak / GIB:.2f} GiB, has {capacity / GIB:.2f} GiB)"


def advice_lines(advice: Sequence) -> str:
    """The changes that fit (with their peaks), then the ones tried that still do not."""
    fitting = [s for s in advice if s.fits]
    lines = ["would fit with one of:" if fitting else
             "no single change tried makes it fit (checkpointing, micro-batch, more ranks, "
             "bfloat16 parameters); combine them"]
    lines += [f"  {s.change:<44} predicted peak {s.outcome.estimate.peak.total / GIB:.2f} GiB"
              for s in fitting]
    if len(fitting) < len(advice):
        lines.append("tried, still too large:")
        lines += [f"  {s.change:<44} predicted peak {s.outcome.estimate.peak.total / GIB:.2f} GiB"
                  for s in advice if not s.fits]
    return "\n".join(lines)


def main(argv: Optional[Sequence[str]] = None) -> None:
    argv = sys.argv[1:] if argv is None else list(argv)
    try:
        args = parse_args(argv)
        env = {"WORLD_SIZE": str(args.world_size),
               "LOCAL_WORLD_SIZE": str(args.world_size // args.nodes)}
        cfg, layout = check(args.overrides, env)
    except ConfigError as exc:
        report(exc, {})
        sys.exit(2)
    from trainer.advice import suggest
    from trainer.plot import plot_plan
    from checkpointing.policies import BudgetError
    from trainer.autofit import (at_micro_batch, decide, fitting, flop_timing,
                                 rows as fit_rows, table as fit_table)
    from trainer.scenario import Evaluator, Scenario, device_type_of

    # The report is for GPUs, where AdamW takes its foreach path (one group-sized temporary),
    # unless the run is for the CPU (train.device=cpu).
    evaluator = Evaluator(args.tflops, optimizer_foreach=cfg.train.device != "cpu",
                          device_type=device_type_of(cfg))
    scenario = Scenario(cfg, layout, args.world_size // args.nodes)
    capacity = capacity_bytes(args, cfg)
    decision = None
    try:
        if fitting(cfg):  # what the trainer's auto would choose, timed by FLOPs here
            if capacity is None:
                raise ConfigError("--gpu-memory-gib", "checkpointing=auto and "
                                  "train.micro_batch_size=auto fit a memory size: pass "
                                  "--gpu-memory-gib or train.memory_gib (no CUDA device here)")
            decision = decide(cfg, scenario, evaluator, capacity, flop_timing(evaluator))
            scenario = at_micro_batch(scenario, decision.micro_batch)
            outcome = evaluator.evaluate(scenario, decision.plan)
        else:
            outcome = evaluator.evaluate(scenario)
    except BudgetError as exc:  # the trainer refuses this budget the same way
        report(ConfigError("checkpointing.budget", str(exc)), {})
        sys.exit(2)
    except ConfigError as exc:  # an impossible train.memory_gib, or a plan file that is wrong
        report(exc, {})
        sys.exit(2)
    peak = outcome.estimate.peak.total
    if decision is not None:
        print(f"auto: micro-batch {decision.micro_batch} (grad_accum {decision.grad_accum}), "
              f"step times from FLOPs at {args.tflops:g} TFLOP/s (the trainer times blocks on "
              "its device); candidates:\n" + fit_table(decision) + "\n")
    print(table(outcome, args.tflops))
    print(verdict(peak, capacity))
    advice = []
    if capacity is not None and peak > capacity:
        advice = suggest(evaluator, scenario, capacity)
        print(advice_lines(advice))
    out = output_dir(args, cfg)
    os.makedirs(out, exist_ok=True)
    data = {"command": argv, "capacity_bytes": capacity,
            "fits": None if capacity is None else peak <= capacity,
            "verdict": verdict(peak, capacity), "tflops": args.tflops, **summary(outcome),
            "blocks": block_rows(outcome),
            "suggestions": [{"change": s.change, "fits": s.fits, **summary(s.outcome)}
                            for s in advice],
            "auto": None if decision is None else {
                "micro_batch_size": decision.micro_batch, "grad_accum": decision.grad_accum,
                "predicted_step_s": decision.step_s, "candidates": fit_rows(decision)}}
    with open(os.path.join(out, "memory_plan.json"), "w") as f:
        json.dump(data, f, indent=1)
    plot_plan(outcome, os.path.join(out, "memory_plan.png"), capacity)
    print(f"wrote {os.path.join(out, 'memory_plan.json')} and memory_plan.png")


if __name__ == "__main__":
    main()
