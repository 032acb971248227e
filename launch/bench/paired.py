"""blocktrain's per-block plan against the plain loop's wrapping, step by step in one process.

    python -m launch.bench.paired [--policies none,full,selective] [--steps 60] [--threads 1]
    torchrun --nproc-per-node 2 -m launch.bench.paired ...

Separate processes compared on this kind of machine differ by 10-20% run to run (other tenants,
memory layout), more than the few percent being looked for. Here both models live in one process
and take turns, step after step, their order alternating: whatever slows the machine for a while
slows both sides of a pair alike, and the median of the per-pair ratios is left. Side "blocktrain":
the built-in Llama (trainer/models/llama.py) with checkpointing.wrap's recompute and
sharding.fsdp's `fully_shard` per block and root; side "plain": launch/bench/plain.py's Llama
with its `torch.utils.checkpoint` wrapping and `fully_shard`. The same initial weights, the same
batches, AdamW and clipping on both, so their losses agree bitwise, which is checked every step.
What this leaves out, the loop around the step (logging, votes, reading data) and the process
(imports, heap), is what `python -m launch.bench --reference` measures and counts.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
import types

import torch
import torch.distributed as dist
import torch.nn.functional as F

from checkpointing.plan import DEFAULT_SAVE_OPS, BlockPlan
from checkpointing.wrap import apply_checkpointing
from launch.bench import plain
from sharding.fsdp import apply_fsdp, build_mesh
from sharding.layout import mesh_layout
from trainer.models.llama import Llama, LlamaArgs, lm_loss

SHAPES = {"dim": 128, "layers": 4, "heads": 4, "kv_heads": 2, "ffn": 384, "vocab": 256}


def _both_models(a, policy: str) -> tuple[torch.nn.Module, torch.nn.Module]:
    torch.manual_seed(a.seed)  # the same weights on every rank, before sharding
    ours = Llama(LlamaArgs(dim=a.dim, n_layers=a.layers, n_heads=a.heads, n_kv_heads=a.kv_heads,
                           vocab_size=a.vocab, ffn_hidden=a.ffn, max_seq_len=a.seq))
    theirs = plain.Decoder(types.SimpleNamespace(**{k: getattr(a, k) for k in SHAPES},
                                                 rope_theta=10000.0, untied=True, dropout=0.0))
    theirs.load_state_dict(ours.state_dict())
    plan = [BlockPlan(i, f"layers.{i}", recompute=policy) for i in range(a.layers)]
    apply_checkpointing(list(ours.layers), plan, DEFAULT_SAVE_OPS)
    apply_fsdp(ours, list(ours.layers), plan, build_mesh(mesh_layout("fsdp", a.world), "cpu"),
               plain.MixedPrecisionPolicy(), reshard_after_forward=True)
    for i, layer in enumerate(theirs.layers):
        plain.with_recompute(layer, policy)
        plain.fully_shard(layer, reshard_after_forward=i != a.layers - 1)
    plain.fully_shard(theirs, reshard_after_forward=True)
    return ours, theirs


def _stepper(model: torch.nn.Module, loss_of):
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)

    def step(inputs: torch.Tensor, targets: torch.Tensor) -> tuple[float, float]:
        started = time.perf_counter()
        loss = loss_of(model, inputs, targets)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        value = loss.item()
        return time.perf_counter() - started, value
    return step


def _plain_loss(model, inputs, targets):
    return F.cross_entropy(model(inputs).flatten(0, 1).float(), targets.flatten(0, 1))


def compare(a, policy: str) -> dict:
    """Per-pair step-time ratios (blocktrain / plain) after `a.warmup` pairs, and whether every
    step's losses were equal."""
    ours, theirs = _both_models(a, policy)
    sides = {"bt": _stepper(ours, lm_loss), "plain": _stepper(theirs, _plain_loss)}
    generator = torch.Generator().manual_seed(a.seed + 1 + a.rank)
    ratios, times, equal = [], {"bt": [], "plain": []}, True
    for i in range(a.warmup + a.steps):
        tokens = torch.randint(0, a.vocab, (a.micro_batch, a.seq + 1), generator=generator)
        batch = tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()
        took = {}
        for side in (("bt", "plain") if i % 2 == 0 else ("plain", "bt")):
            took[side] = sides[side](*batch)
        equal = equal and took["bt"][1] == took["plain"][1]
        if i >= a.warmup:
            ratios.append(took["bt"][0] / took["plain"][0])
            for side in times:
                times[side].append(took[side][0])
    return {"ratios": ratios, "times": times, "equal": equal}


def row(policy: str, got: dict) -> str:
    """Rank 0's figures: under FSDP the ranks meet at every collective, so a step ends within a
    hair of the same time on each."""
    q1, median, q3 = statistics.quantiles(got["ratios"], n=4)
    ms = {side: statistics.median(t) * 1e3 for side, t in got["times"].items()}
    return (f"| {policy} | {median:.3f} ({q1:.3f}-{q3:.3f}) | {ms['bt']:.1f} / {ms['plain']:.1f} "
            f"| {'yes' if got['equal'] else 'NO'} |")


def _setup(a) -> bool:
    """Join torchrun's group or make one of one rank, as the plain loop does; False: the
    caller's group (tests)."""
    own = not dist.is_initialized()
    if own:
        plain.setup(argparse.Namespace(device="cpu"))
    a.rank, a.world = dist.get_rank(), dist.get_world_size()
    return own


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    for name, default in (*SHAPES.items(), ("seq", 256), ("micro-batch", 8), ("steps", 60),
                          ("warmup", 3), ("seed", 0), ("threads", 1)):
        p.add_argument(f"--{name.replace('_', '-')}", type=int, default=default)
    p.add_argument("--policies", default="none,full,selective")
    a = p.parse_args(argv)
    if a.steps < 4:
        p.error("--steps must be >= 4 (quartiles of the per-pair ratios)")
    own_group = _setup(a)
    torch.set_num_threads(a.threads)
    lines = []
    for policy in a.policies.split(","):
        lines.append(row(policy, compare(a, policy)))
    if a.rank == 0:
        print(f"# torch {torch.__version__}, {a.world} rank(s), {a.threads} thread(s) each, "
              f"{a.micro_batch} x {a.seq} tokens per rank, {a.steps} pairs after {a.warmup}")
        print("| policy | blocktrain / plain, per pair: median (quartiles) | median step ms: "
              "blocktrain / plain | losses bitwise equal |")
        print("|---|---|---|---|")
        print("\n".join(lines), flush=True)
    ok = all(line.endswith("yes |") for line in lines)
    if own_group:
        dist.barrier()  # no rank tears its gloo pairs down while a peer still sends
        dist.destroy_process_group()
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
