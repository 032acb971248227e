"""`python -m trainer.report [--world-size N] [--nodes M] [--gpu-memory-gib G] <overrides>`.

The pre-flight "will it fit" report: the trainer's plan for this config, every block's saved
bytes and recompute FLOPs, the per-rank memory of a step (see checkpointing/planner/memory.py) and a
verdict against the GPU's memory, with the changes that would make it fit. Everything is
measured on the meta device, so it runs on a laptop for a 70B model in seconds. Writes
memory_plan.json and memory_plan.png to --out (default: a new <train.out_dir>/reports/<time>).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from typing import Optional, Sequence

from trainer.cli import check, print_error
from trainer.config import ConfigError
from trainer.preflight.tables import (DEFAULT_TFLOPS, GIB, advice_lines, block_rows, summary, table,
                                verdict)


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
    from trainer.preflight.auto_plan import fitting

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


def main(argv: Optional[Sequence[str]] = None) -> None:
    argv = sys.argv[1:] if argv is None else list(argv)
    try:
        args = parse_args(argv)
        env = {"WORLD_SIZE": str(args.world_size),
               "LOCAL_WORLD_SIZE": str(args.world_size // args.nodes)}
        cfg, layout = check(args.overrides, env)
    except ConfigError as exc:
        print_error(exc, {})
        sys.exit(2)
    from trainer.task import with_head_share

    cfg, head_note = with_head_share(cfg)  # the head's rows: the prepared data's share
    from trainer.preflight.advice import suggest
    from trainer.preflight.plot import plot_plan
    from trainer.preflight.timeline import picture_line
    from checkpointing.planner.policies import BudgetError
    from trainer.preflight.auto_plan import (at_micro_batch, decide, fitting, flop_timing,
                                 rows as fit_rows, table as fit_table)
    from trainer.preflight.scenario import Evaluator, Scenario, device_type_of

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
        print_error(ConfigError("checkpointing.budget", str(exc)), {})
        sys.exit(2)
    except ConfigError as exc:  # an impossible train.memory_gib, or a plan file that is wrong
        print_error(exc, {})
        sys.exit(2)
    peak = outcome.estimate.peak.total
    if decision is not None:
        print(f"auto: micro-batch {decision.micro_batch} (grad_accum {decision.grad_accum}), "
              f"step times from FLOPs at {args.tflops:g} TFLOP/s (the trainer times blocks on "
              "its device); candidates:\n" + fit_table(decision) + "\n")
    print(table(outcome, args.tflops))
    if head_note is not None:
        print(f"head: {cfg.checkpointing.head}, {head_note}")
    print(picture_line(outcome, capacity))  # the picture's story, for those who never open it
    print(verdict(peak, capacity))
    advice = []
    if capacity is not None and peak > capacity:
        advice = suggest(evaluator, scenario, capacity)
        print(advice_lines(advice))
    out = output_dir(args, cfg)
    os.makedirs(out, exist_ok=True)
    data = {"command": argv, "capacity_bytes": capacity,
            "fits": None if capacity is None else peak <= capacity,
            "verdict": verdict(peak, capacity), "tflops": args.tflops, "head_rows": head_note,
            **summary(outcome),
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
