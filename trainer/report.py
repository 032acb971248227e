"""`python -m trainer.report [--world-size N] [--nodes M] [--gpu-memory-gib G] <overrides>`.

The pre-flight "will it fit" report: the trainer's plan for this config, every block's saved
bytes and recompute FLOPs, the per-rank memory of a step (see checkpointing/planner/memory.py) and a
verdict against the GPU's memory, with the changes that would make it fit. Everything is
measured on the meta device, so it runs on a laptop for a 70B model in seconds. Writes
memory_plan.json and memory_plan.png to --out (default: a new <train.out_dir>/reports/<time>).

Exit status, for job scripts: 0 when it fits (or nothing is judged: no memory size given), 3 when
it does NOT fit, on the device or in host memory (--host-memory-gib), 2 for bad input.
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


NO_FIT_EXIT = 3  # the exit status when it does not fit (device or host memory)


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
    parser.add_argument("--host-memory-gib", type=float, default=None,
                        help="host memory per node for the verdict on pinned offloaded "
                             "activations (and sharding.cpu_offload state), less "
                             "train.host_reserve_gib (default 10%% of it)")
    parser.add_argument("--longest", action="store_true",
                        help="search the longest data.seq_len that fits (the given or auto "
                             "plan, tiles, sequence degree) and report it; the search starts "
                             "at data.seq_len: give a length near the answer")
    parser.add_argument("--longest-step", type=int, default=1024,
                        help="--longest: lengths are multiples of this many tokens (and of "
                             "the sequence degree); fewer lengths to try when larger")
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
    if args.host_memory_gib is not None and not args.host_memory_gib > 0:
        raise ConfigError("--host-memory-gib", f"must be > 0, got {args.host_memory_gib}")
    if args.longest_step < 1:
        raise ConfigError("--longest-step", f"must be a positive integer, got {args.longest_step}")
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


def capacity_bytes(args: argparse.Namespace, cfg, layout) -> Optional[int]:
    """train.memory_gib, else --gpu-memory-gib or the visible CUDA device less
    train.memory_reserve_gib (the CUDA context, NCCL and the allocator's cache, which the memory
    model does not count; as the trainer's auto keeps it: trainer/preflight/auto_run.capacity_of)."""
    if cfg.train.memory_gib is not None:
        return int(cfg.train.memory_gib * GIB)
    reserve = int(cfg.train.memory_reserve_gib * GIB)
    if args.gpu_memory_gib is not None:
        total = int(args.gpu_memory_gib * GIB)
    else:
        import torch

        if not torch.cuda.is_available():
            return None
        total = torch.cuda.get_device_properties(0).total_memory
    if total - reserve <= 0:
        raise ConfigError("train.memory_reserve_gib", f"{cfg.train.memory_reserve_gib} GiB "
                          f"leaves nothing of {total / GIB:.1f} GiB")
    return total - reserve


def predict(scenario, evaluator, capacity: Optional[int], tflops: float):
    """(outcome, auto's decision or None) of one configuration, as the trainer would plan it."""
    from trainer.preflight.auto_plan import at_decision, auto_decides, decide, flop_timing

    if not auto_decides(scenario.cfg, scenario.layout):
        return evaluator.evaluate(scenario), None
    if capacity is None:
        raise ConfigError("--gpu-memory-gib", "auto (checkpointing, micro-batch, tiles or "
                          "sequence degree) fits a memory size: pass --gpu-memory-gib or "
                          "train.memory_gib (no CUDA device here)")
    decision = decide(scenario.cfg, scenario, evaluator, capacity, flop_timing(evaluator))
    return evaluator.evaluate(at_decision(scenario, decision), decision.plan), decision


def predict_longest(scenario, evaluator, capacity: Optional[int], host: Optional[int],
                    tflops: float, step_tokens: int):
    """--longest: (outcome, decision, the search's lengths tried): device and host must fit."""
    from trainer.preflight.host_memory import host_verdict
    from trainer.preflight.longest import longest

    if capacity is None:
        raise ConfigError("--gpu-memory-gib", "--longest needs a memory size to fit")

    def attempt(at):
        try:
            outcome, decision = predict(at, evaluator, capacity, tflops)
        except ConfigError as exc:  # auto: nothing fits at this length
            if exc.key in ("train.memory_gib", "sharding.sequence"):
                return False, None, None
            raise
        host_fits = host_verdict(outcome, host, scenario.cfg.train.host_reserve_gib).fits
        return outcome.estimate.peak.total <= capacity and host_fits is not False, outcome, decision

    def use(outcome) -> float:  # of the binding limit: guides the search (longest.py)
        v = host_verdict(outcome, host, scenario.cfg.train.host_reserve_gib)
        return max(outcome.estimate.peak.total / capacity,
                   v.per_node / v.usable if v.usable else 0.0)

    found = longest(scenario, attempt, step_tokens, use)
    return found.outcome, found.decision, found.tried


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
    from trainer.preflight.auto_plan import auto_table
    from trainer.preflight.scenario import Evaluator, Scenario, device_type_of
    from trainer.preflight.host_memory import reserve_bytes
    from trainer.preflight.verdicts import verdicts

    # The report is for GPUs, where AdamW takes its foreach path (one group-sized temporary),
    # unless the run is for the CPU (train.device=cpu).
    evaluator = Evaluator(args.tflops, optimizer_foreach=cfg.train.device != "cpu",
                          device_type=device_type_of(cfg))
    scenario = Scenario(cfg, layout, args.world_size // args.nodes)
    host = None if args.host_memory_gib is None else int(args.host_memory_gib * GIB)
    tried = None
    try:
        if host is not None:  # a reserve that leaves nothing: one line, before any tracing
            reserve_bytes(host, cfg.train.host_reserve_gib)
        capacity = capacity_bytes(args, cfg, layout)
        if args.longest:
            outcome, decision, tried = predict_longest(scenario, evaluator, capacity, host,
                                                       args.tflops, args.longest_step)
        else:
            outcome, decision = predict(scenario, evaluator, capacity, args.tflops)
    except BudgetError as exc:  # the trainer refuses this budget the same way
        print_error(ConfigError("checkpointing.budget", str(exc)), {})
        sys.exit(2)
    except ConfigError as exc:  # an impossible train.memory_gib, or a plan file that is wrong
        print_error(exc, {})
        sys.exit(2)
    peak = outcome.estimate.peak.total
    scenario = outcome.scenario
    if tried is not None:
        print(longest_line(outcome, tried))
    if decision is not None:
        print(f"auto: micro-batch {decision.micro_batch} (grad_accum {decision.grad_accum}), "
              f"step times from FLOPs at {args.tflops:g} TFLOP/s (the trainer times blocks on "
              "its device); candidates:\n" + auto_table(decision) + "\n")
    print(table(outcome, args.tflops) + "\n" + attention_line(outcome, evaluator))
    if head_note is not None:
        print(f"head: {cfg.checkpointing.head}, {head_note}")
    print(picture_line(outcome, capacity))  # the picture's story, for those who never open it
    judged = verdicts(outcome, capacity, host, args.tflops, evaluator.device_type)
    print("\n".join([*judged.step_lines, verdict(peak, capacity), *judged.host_lines]))
    advice = []
    if capacity is not None and peak > capacity:
        advice = suggest(evaluator, scenario, capacity)
        print(advice_lines(advice))
    out = output_dir(args, cfg)
    os.makedirs(out, exist_ok=True)
    data = plan_data(argv, args, outcome, decision, tried, capacity, host, head_note, advice,
                     {**judged.keys, **attention_keys(outcome, evaluator)})
    with open(os.path.join(out, "memory_plan.json"), "w") as f:
        json.dump(data, f, indent=1)
    plot_plan(outcome, os.path.join(out, "memory_plan.png"), capacity)
    print(f"wrote {os.path.join(out, 'memory_plan.json')} and memory_plan.png")
    if judged.fits is False:  # for job scripts: 3, documented (the module's docstring)
        sys.exit(NO_FIT_EXIT)


def plan_data(argv, args, outcome, decision, tried, capacity, host, head_note, advice,
              verdict_keys: dict) -> dict:
    """memory_plan.json's contents (verdict_keys: the verdicts' and the attention kernel's)."""
    from trainer.preflight.auto_plan import auto_rows

    peak = outcome.estimate.peak.total
    return {"command": argv, "capacity_bytes": capacity, "host_capacity_bytes": host,
            "longest": None if tried is None else {
                "seq_len": outcome.scenario.cfg.data.seq_len,
                "tried": [{"seq_len": n, "fits": f} for n, f in tried]},
            **verdict_keys,
            "verdict": verdict(peak, capacity), "tflops": args.tflops, "head_rows": head_note,
            **summary(outcome),
            "blocks": block_rows(outcome),
            "suggestions": [{"change": s.change, "fits": s.fits, **summary(s.outcome)}
                            for s in advice],
            "auto": None if decision is None else {
                "micro_batch_size": decision.micro_batch, "grad_accum": decision.grad_accum,
                "sequence": decision.sequence, "context": decision.context, "tiles": decision.tiles,
                "predicted_step_s": decision.step_s, "candidates": auto_rows(decision)}}


def attention_keys(outcome, evaluator) -> dict:
    """memory_plan.json's attention_backend (the kernel counted) and attention_workspace_bytes
    (its backward workspace at one block's attention, already inside the peak)."""
    from trainer.models.families.attention_backend import resolve

    return {"attention_backend": resolve(outcome.scenario.cfg, evaluator.device_type)[0],
            "attention_workspace_bytes": outcome.profile.attention_workspace_bytes}


def attention_line(outcome, evaluator) -> str:
    """'attention: <backend> (<why>); backward workspace ... per block, counted in the peak'."""
    from trainer.models.families.attention_backend import resolve

    backend, why = resolve(outcome.scenario.cfg, evaluator.device_type)
    workspace = outcome.profile.attention_workspace_bytes
    counted = (f"backward workspace {workspace / GIB:.2f} GiB at each block's attention, counted "
               "in the peak" if workspace else "no workspace beyond its inputs and gradients")
    return f"attention: {backend} ({why}); {counted}"


def longest_line(outcome, tried) -> str:
    """'longest: data.seq_len=... fits: ... tokens per rank, ... per node (lengths tried)'."""
    from trainer.config import tile_count

    sc = outcome.scenario
    seq_len, micro = sc.cfg.data.seq_len, sc.layout.micro_batch_size
    degree, tiles = sc.layout.degree, tile_count(sc.cfg.checkpointing)
    per_rank = seq_len * micro // sc.layout.share
    ring = f"sharding.context={sc.layout.context}, " if sc.layout.context > 1 else ""
    return (f"longest: data.seq_len={seq_len} fits (sharding.sequence={degree}, {ring}"
            f"checkpointing.tiles={tiles}, micro-batch {micro}): {per_rank:,} tokens per rank, "
            f"{per_rank * sc.gpus_per_node:,} per node of {sc.gpus_per_node}; lengths tried: "
            + ", ".join(f"{n}{'' if f else ' (no)'}" for n, f in tried))


if __name__ == "__main__":
    main()
