"""The pre-flight "will it fit" report, as tables and a verdict: the trainer's plan for a config,
every block's saved bytes and recompute FLOPs, the per-rank memory of a step (see
checkpointing/planner/memory.py) and the changes that would make it fit. The command is
trainer/report.py (`python -m trainer.report`).
"""

from __future__ import annotations

import re
from dataclasses import asdict
from typing import Optional, Sequence

from trainer.config import tile_count
from trainer.task import task_for

GIB = 2 ** 30
DEFAULT_TFLOPS = 400.0


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


def _tokens_per_sample(sc) -> int:
    return task_for(sc.cfg.model, sc.cfg.data, sc.cfg.checkpointing).tokens_per_sample


def summary(outcome) -> dict:
    """Every number of one prediction, for memory_plan.json."""
    est, sc = outcome.estimate, outcome.scenario
    return {
        "world_size": sc.layout.world_size, "nodes": sc.layout.world_size // sc.gpus_per_node,
        "sharding": sc.cfg.sharding.mode, "shard": sc.layout.shard,
        "replicate": sc.layout.replicate, "grad_accum": sc.layout.grad_accum,
        "micro_batch_size": sc.cfg.train.micro_batch_size,
        "tokens_per_sample": _tokens_per_sample(sc),
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
        "sequence": sc.layout.degree, "context": sc.layout.context,
        "tiles": tile_count(sc.cfg.checkpointing), "exchange": _exchange(outcome),
        "host_per_rank_bytes": {"offloaded_activations": est.host_activations,
                                "params_grads_optimizer": est.host,
                                "total": est.host + est.host_activations},
        "host_per_node_bytes": (est.host + est.host_activations) * sc.gpus_per_node,
        "budget_bytes": outcome.budget.bytes if outcome.budget else None,
        "rest_bytes": outcome.profile.rest_bytes,
        "head": asdict(outcome.profile.head),
    }


def _exchange(outcome) -> dict:
    from trainer.preflight.exchange import exchange_summary

    return exchange_summary(outcome)


def table(outcome, tflops: float) -> str:
    est, sc = outcome.estimate, outcome.scenario
    tokens = _tokens_per_sample(sc)
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
        f"{sc.cfg.train.micro_batch_size} x {tokens} tokens{sequence_text(sc, tokens)}, "
        f"grad_accum {sc.layout.grad_accum}, param dtype {dtype}",
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
    frozen = frozen_line(outcome)
    if frozen:
        lines.append(frozen)
    if est.host:
        lines.append(f"host memory (sharding.cpu_offload): parameters, gradients and optimizer "
                     f"state {est.host / GIB:.2f} GiB per rank, not on the GPU")
    if est.host_activations:
        lines.append(f"host memory (offload=cpu): {est.host_activations / GIB:.2f} GiB of pinned "
                     f"offloaded activations per rank at the end of the forward, "
                     f"{est.host_activations * sc.gpus_per_node / GIB:.2f} GiB per node of "
                     f"{sc.gpus_per_node} ranks")
    from trainer.preflight.exchange import exchange_lines

    lines += exchange_lines(outcome)
    for note in not_modeled(sc.cfg):
        lines.append(f"note: {note}")
    if outcome.budget is not None:
        lines.append(f"budget: {outcome.budget.bytes / GIB:.2f} GiB of activations per rank "
                     f"(no checkpointing: {outcome.budget.no_checkpoint_bytes / GIB:.2f} GiB)")
    return "\n".join(lines)


def frozen_line(outcome) -> Optional[str]:
    """What the frozen parameters (model.lora's base, model.freeze) cost, where some are: the
    parameters line above holds their storage, the unsharded line a block's dequantized weight."""
    import math

    from checkpointing.planner.param_bytes import sharded_numel

    sc = outcome.scenario
    shard = sc.layout.shard if sc.cfg.sharding.mode != "none" else 1
    trained = stored = dense = 0
    frozen = False
    for g in outcome.groups:
        n = len(g.shapes)
        for shape, is_trained, size in zip(g.shapes, g.trained or (True,) * n,
                                           g.itemsizes or (4,) * n):
            if is_trained:
                trained += math.prod(shape or (1,))
            else:
                frozen = True
                stored += sharded_numel(shape, shard) * size
        dense = max(dense, g.transient_numel)
    if not frozen:
        return None
    lora = sc.cfg.model.lora
    what = (f"model.lora r={lora.rank}" + (", base in nf4" if lora.quantize == "nf4" else "")
            if lora.on else "model.freeze")
    line = (f"frozen ({what}): {trained / 1e6:,.3f}M parameters trained; the frozen rest has "
            f"no gradients nor optimizer state, stored {stored / GIB:.2f} GiB per rank")
    if dense:
        compute = 2 if sc.cfg.sharding.param_dtype in ("bfloat16", "float16") else 4
        line += (f"; a block's largest dequantized weight {dense * compute / GIB:.2f} GiB while "
                 "it runs (in the unsharded line)")
    return line


def sequence_text(sc, tokens: int) -> str:
    """', sequence 8 (1/8 of each sample's tokens on this rank), MLP in 16 tiles'."""
    degree, tiles, context = sc.layout.degree, tile_count(sc.cfg.checkpointing), sc.layout.context
    share = degree * context
    ranks = f"sequence {degree}" + (f" x context {context}" if context > 1 else "")
    text = (f", {ranks} ({tokens // share} of each sample's tokens on this rank)"
            if share > 1 else "")
    return text + (f", {tiles} sequence tiles" if tiles > 1 else "")


def host_check(outcome) -> list[str]:
    """The pinned pool (offload.max_host_bytes) against what one rank offloads (the host
    verdict itself is trainer/preflight/host_memory.py's)."""
    est, sc = outcome.estimate, outcome.scenario
    lines = []
    pool = sc.cfg.offload.max_host_bytes
    if est.host_activations > pool:
        lines.append(f"offload.max_host_bytes: the pinned pool ({pool / GIB:.2f} GiB) holds less "
                     f"than the {est.host_activations / GIB:.2f} GiB this plan offloads per rank "
                     f"(what does not fit stays on the GPU); set offload.max_host_bytes="
                     f"{-(-est.host_activations // GIB) * GIB} or more")
    return lines


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
