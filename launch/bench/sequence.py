"""`python -m launch.bench --sequence`: what sharding.sequence and checkpointing.tiles buy on CPU.

1. The trainer on P ranks (gloo) at one long sequence, sharding.sequence=P against 1 with the
   same global batch (the same samples): each rank's live tensor peak (logging.live_bytes_step,
   step 2) and the median step time (steps 3 on; steps 1 and 2 are not timed). With
   --context M, a third row: sharding.sequence=P/M x sharding.context=M (ring attention;
   model.dropout=0 in every row then, as the ring has no attention dropout).
2. One recomputed block of the same model alone (checkpointing=full's wrapper), its MLP in T
   tiles against whole: the peak live bytes of its forward and backward (the backward's, since
   a recomputed block keeps only its input) and the median time.

Step times on a shared machine move; the memory columns are counts, not clocks.
"""

from __future__ import annotations

import argparse
import datetime
import statistics
import tempfile
import time
from typing import Optional

import torch

from launch.bench.policies import run_policy, torch_version

MIB = 2.0 ** -20


def trainer_rows(seq_len: int, nproc: int, steps: int, overrides: list[str],
                 context: int = 1) -> dict[str, dict]:
    """{row: live peak per rank (bytes), median step seconds, last loss} for sequence 1 and
    nproc, and sequence nproc/context x context when context > 1."""
    common = ["model=tiny", "data=synthetic", f"data.seq_len={seq_len}",
              f"model.max_seq_len={seq_len}", f"train.global_batch_size={nproc}",
              "train.micro_batch_size=1", "train.eval_batches=1", "save.every=0",
              "logging.live_bytes_step=2", *overrides]
    if context > 1:
        common.append("model.dropout=0")
    shapes = [("1", ["sharding.sequence=1"]), (str(nproc), [f"sharding.sequence={nproc}"])]
    if context > 1:
        shapes.append((f"{nproc // context}xctx{context}",
                       [f"sharding.sequence={nproc // context}", f"sharding.context={context}"]))
    rows = {}
    for degree, shape in shapes:
        with tempfile.TemporaryDirectory() as out:
            logged = run_policy("none", "none", [*common, *shape], steps, nproc, out)
        live = next(m["live_peak_bytes"] for m in logged if "live_peak_bytes" in m)
        times = [m["step_time_s"] for m in logged if "step_time_s" in m and m["step"] > 2]
        rows[degree] = {"live": live, "step": statistics.median(times),
                        "loss": [m["loss"] for m in logged if "loss" in m][-1]}
    return rows


def block_rows(seq_len: int, tiles: list[int], repeats: int) -> dict[int, dict]:
    """{tiles: peak live bytes and median seconds of one recomputed tiny block's forward and
    backward at seq_len tokens}."""
    from checkpointing.plan import BlockPlan
    from checkpointing.planner.metatrace import LiveBytes
    from checkpointing.wrap import apply_checkpointing
    from trainer.cli import compose
    from trainer.models.families.llama import llama_args
    from trainer.models.llama import Block, rope_cos_sin

    args = llama_args(compose(["model=tiny", f"model.max_seq_len={seq_len}"]).model)
    rope = rope_cos_sin(args.head_dim, seq_len, args.rope_theta, torch.device("cpu"))
    hidden = torch.randn(1, seq_len, args.dim, generator=torch.Generator().manual_seed(0))
    rows = {}
    for n in tiles:
        torch.manual_seed(0)
        block = Block(args)
        block.tile(n)  # both norms, wq/wk/wv and the MLP in n tiles
        apply_checkpointing([block], [BlockPlan(0, "block", recompute="full")], ())

        def step() -> float:
            x = hidden.detach().requires_grad_()
            start = time.perf_counter()
            block(x, rope).sum().backward()
            return time.perf_counter() - start

        step()  # warm-up
        with LiveBytes() as live:
            step()
        times = [step() for _ in range(repeats)]
        grad = block.feed_forward.w1.weight.grad  # summed over every step above
        rows[n] = {"peak": live.peak, "step": statistics.median(times), "grad": grad.clone()}
        block.zero_grad(set_to_none=True)
    return rows


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m launch.bench --sequence",
                                     description=__doc__.splitlines()[0])
    parser.add_argument("--seq-len", type=int, default=4096)
    parser.add_argument("--nproc", type=int, default=2)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--tiles", default="1,4,16", help="comma-separated; the first is the base")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--context", type=int, default=1,
                        help="a ring of this many places in a third row (divides --nproc)")
    args, overrides = parser.parse_known_args(argv)
    if args.steps < 4:
        parser.error("--steps must be >= 4 (step 2 counts live bytes; steps 3 on are timed)")
    print(f"{datetime.date.today()}  torch {torch_version()}  tiny Llama, seq {args.seq_len}, "
          f"{args.nproc} ranks (gloo), global batch {args.nproc}, overrides {overrides or '-'}")
    if args.context < 1 or args.nproc % args.context:
        parser.error(f"--context {args.context} must divide --nproc {args.nproc}")
    rows = trainer_rows(args.seq_len, args.nproc, args.steps, overrides, args.context)
    base = rows["1"]
    print(f"{'sharding.sequence':>17} {'live peak/rank MiB':>19} {'ratio':>6} {'step s':>7} "
          f"{'ratio':>6} {'last loss':>10}")
    for degree, row in rows.items():
        print(f"{degree:>17} {row['live'] * MIB:>19.1f} {row['live'] / base['live']:>6.3f} "
              f"{row['step']:>7.3f} {row['step'] / base['step']:>6.2f} {row['loss']:>10.6f}")
    tiles = [int(t) for t in args.tiles.split(",")]
    blocks = block_rows(args.seq_len, tiles, args.repeats)
    first = blocks[tiles[0]]
    print(f"one recomputed block (checkpointing=full), seq {args.seq_len}, median of "
          f"{args.repeats} after a warm-up")
    print(f"{'tiles':>5} {'fwd+bwd peak MiB':>17} {'ratio':>6} {'step s':>7} {'ratio':>6} "
          f"{'grad rel diff':>14}")
    for n, row in blocks.items():
        diff = ((row["grad"] - first["grad"]).abs().max() / first["grad"].abs().max()).item()
        print(f"{n:>5} {row['peak'] * MIB:>17.1f} {row['peak'] / first['peak']:>6.3f} "
              f"{row['step']:>7.3f} {row['step'] / first['step']:>6.2f} {diff:>14.2e}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
