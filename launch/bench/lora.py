"""`python -m launch.bench.lora`: LoRA (model.lora) against a full fine-tune of the same model
on CPU, each built by the trainer (FSDP2 in a world of one): live bytes of the gradients and
AdamW state after a step, and the median step time (forward, backward, optimizer step).

The issue's target: a LoRA r=16 run's gradients + optimizer state <= 2% of the full
fine-tune's. Step times are of this process alone; on a shared machine say so with the figure.
"""

from __future__ import annotations

import argparse
import datetime
import os
import statistics
import time
from typing import Optional

import torch


def _tensor_bytes(tensors) -> int:
    seen, total = set(), 0
    for t in tensors:
        if torch.is_tensor(t):
            local = t.to_local() if hasattr(t, "to_local") else t
            key = local.untyped_storage().data_ptr()
            if key not in seen:
                seen.add(key)
                total += local.untyped_storage().nbytes()
    return total


def _run(overrides: list[str], steps: int) -> dict:
    """Gradient bytes after backward (as at the optimizer step), AdamW state bytes, and the
    median seconds per step of `steps` steps after one warm-up step."""
    from checkpointing.meter import SavedBytesMeter
    from trainer.build import build_model
    from trainer.cli import compose
    from trainer.distenv import read_env
    from trainer.models.llama import lm_loss
    from trainer.optim import build_optimizer
    from trainer.validate import validate

    cfg = compose(overrides)
    built = build_model(cfg, read_env("cpu"), layout=validate(cfg, world_size=1),
                        meter=SavedBytesMeter())
    model, optimizer = built.model, build_optimizer(built.model, cfg.optim)
    vocab, seq, batch = cfg.model.vocab_size, cfg.data.seq_len, cfg.train.micro_batch_size
    generator = torch.Generator().manual_seed(0)
    times, grads, state = [], 0, 0
    for step in range(steps + 1):
        tokens = torch.randint(0, vocab, (batch, seq + 1), generator=generator)
        start = time.perf_counter()
        lm_loss(model, tokens[:, :-1], tokens[:, 1:]).backward()
        grads = _tensor_bytes(p.grad for p in model.parameters() if p.grad is not None)
        optimizer.step()
        optimizer.zero_grad()
        if step:  # the first step allocates the optimizer state
            times.append(time.perf_counter() - start)
    state = _tensor_bytes(t for s in optimizer.state.values() for t in s.values()
                          if torch.is_tensor(t) and t.numel() > 1)
    params = _tensor_bytes(model.parameters())
    trained = sum(p.numel() for p in model.parameters() if p.requires_grad)
    return {"grads": grads, "optimizer": state, "params": params, "trained": trained,
            "step_s": statistics.median(times)}


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m launch.bench.lora", description=__doc__)
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--dim", type=int, default=1024)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--seq", type=int, default=256)
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--only", choices=("full", "lora"), default=None,
                        help="run one of the two (for paired whole-process timing, e.g. "
                             "farm-bench --vs '... --only full' -- ... --only lora)")
    args = parser.parse_args(argv)
    from trainer.distenv import init_distributed, read_env, shutdown

    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE"):
        os.environ.pop(key, None)
    model = [f"model.dim={args.dim}", f"model.n_layers={args.layers}", "model.n_heads=8",
             "model.n_kv_heads=8", f"model.ffn_hidden={args.dim * 11 // 4}",
             f"model.vocab_size={args.vocab}", f"model.max_seq_len={args.seq}",
             f"data.seq_len={args.seq}", f"train.micro_batch_size={args.batch}",
             "data=synthetic", "logging.wandb=false"]
    lora_run = [*model, f"model.lora.rank={args.rank}"]
    init_distributed(read_env("cpu"), timeout_s=600)
    try:
        if args.only:
            row = _run(model if args.only == "full" else lora_run, args.steps)
            print(f"{args.only}: grads+optim {(row['grads'] + row['optimizer']) / 2**20:.2f} "
                  f"MiB, step {row['step_s']:.3f} s")
            return 0
        full = _run(model, args.steps)
        lora = _run(lora_run, args.steps)
    finally:
        shutdown()
    print(f"# {datetime.date.today()} CPU ({torch.get_num_threads()} threads), llama dim "
          f"{args.dim} x {args.layers} layers, vocab {args.vocab}, {args.batch} x {args.seq} "
          f"tokens, fp32, LoRA r={args.rank} on every block linear")
    print(f"{'run':<12} {'trained':>12} {'grads MiB':>10} {'optim MiB':>10} "
          f"{'grads+optim':>12} {'step s':>8}")
    for name, row in (("full", full), (f"lora r={args.rank}", lora)):
        both = row["grads"] + row["optimizer"]
        print(f"{name:<12} {row['trained']:>12,} {row['grads'] / 2**20:>10.2f} "
              f"{row['optimizer'] / 2**20:>10.2f} {both / 2**20:>12.2f} {row['step_s']:>8.3f}")
    ratio = (lora["grads"] + lora["optimizer"]) / (full["grads"] + full["optimizer"])
    print(f"lora/full: gradients + optimizer state {100 * ratio:.2f}% (target <= 2%), "
          f"step time {lora['step_s'] / full['step_s']:.2f}x")
    return 0 if ratio <= 0.02 else 1


if __name__ == "__main__":
    raise SystemExit(main())
