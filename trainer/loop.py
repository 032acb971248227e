"""The training run: set up once, then a loop whose step reads top to bottom.

Eval, logging and (later) state saving sit outside `train_step` behind "every N steps" guards.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import time
from typing import Optional, Sequence

import torch
import torch.distributed as dist
from torch import nn

from checkpointing.plan import describe, plan_rows, plan_table, plan_to_json
from checkpointing.policies import added_seconds
from checkpointing.saved import SavedBytesMeter
from offload.apply import close_offloader, offload_micro_batch
from offload.engine import Offloader
from launch.env import DistEnv, init_distributed, read_env, shutdown
from sharding.fsdp import reshard_all, set_grad_sync
from trainer.build import Built, build_model, llama_args
from trainer.config import Config, Layout
from trainer.data import build_datasets, train_batch, val_batches
from trainer.model import flops_per_token, lm_loss
from trainer.metrics import RunLogger, peak_flops, peak_memory_bytes
from trainer.optim import build_optimizer, build_scheduler, clip_grad_norm

log = logging.getLogger("trainer")
Batch = tuple[torch.Tensor, torch.Tensor]


def train_step(model: nn.Module, optimizer: torch.optim.Optimizer, scheduler,
               micro_batches: Sequence[Batch], grad_clip: float, meter: SavedBytesMeter,
               offloader: Optional[Offloader]) -> tuple[torch.Tensor, torch.Tensor]:
    """One optimizer step over this rank's micro-batches; returns (mean loss, grad norm)."""
    total_loss = torch.zeros((), device=micro_batches[0][0].device)
    for i, (inputs, targets) in enumerate(micro_batches):
        # Cross-rank reduction is deferred to the last micro-batch where that saves traffic.
        set_grad_sync(model, i == len(micro_batches) - 1)
        with offload_micro_batch(offloader):  # planned blocks' activations leave the device
            with meter.measure():  # counts what this forward keeps on the device for backward
                loss = lm_loss(model, inputs, targets) / len(micro_batches)
            loss.backward()
        total_loss += loss.detach()
    grad_norm = clip_grad_norm(model.parameters(), grad_clip)
    optimizer.step()
    scheduler.step()
    optimizer.zero_grad(set_to_none=True)
    return total_loss, grad_norm


def mean_over_ranks(value: torch.Tensor) -> float:
    if dist.is_initialized() and dist.get_world_size() > 1:
        value = value.clone()
        dist.all_reduce(value)  # gloo has no AVG: sum, then divide
        value /= dist.get_world_size()
    return value.item()


@torch.no_grad()
def evaluate(model: nn.Module, batches: Sequence[Batch]) -> float:
    model.eval()
    total = torch.zeros((), device=batches[0][0].device)
    for inputs, targets in batches:
        total += lm_loss(model, inputs, targets)
    reshard_all(model)
    model.train()
    return mean_over_ranks(total / len(batches))


def _to(batches: Sequence[Batch], device: torch.device) -> list[Batch]:
    return [(x.to(device, non_blocking=True), y.to(device, non_blocking=True)) for x, y in batches]


def train(cfg: Config, layout: Layout, run_dir: str) -> None:
    denv = read_env(cfg.train.device)
    init_distributed(denv, cfg.train.dist_timeout_s)
    try:
        _train(cfg, layout, run_dir, denv)
    except BaseException:
        shutdown(clean=False)
        raise
    shutdown()


def _start_logging(cfg: Config, denv: DistEnv, run_dir: str) -> RunLogger:
    if not denv.is_main:
        return RunLogger(None, cfg.train.steps, progress=False)
    wandb_run = None
    if cfg.logging.wandb:
        from trainer.wandb_log import WandbLogger

        wandb_run = WandbLogger.start(run_dir, dataclasses.asdict(cfg), cfg.logging.wandb_project,
                                      cfg.logging.wandb_entity, os.path.basename(run_dir),
                                      cfg.logging.wandb_init_timeout_s)
    return RunLogger(run_dir, cfg.train.steps, cfg.logging.progress, wandb_run)


def _train(cfg: Config, layout: Layout, run_dir: str, denv: DistEnv) -> None:
    t, device = cfg.train, denv.device
    # Dropout masks differ per rank (as their data does) but repeat run to run.
    torch.manual_seed(t.seed + denv.rank)

    meter = SavedBytesMeter()
    built = build_model(cfg, denv, layout.replicate, meter, run_dir)
    try:
        _run(cfg, layout, run_dir, denv, built, meter)
    finally:
        # Joins its threads; no file outlives the run, also when it failed.
        close_offloader(built.offloader, own_parent=cfg.offload.dir is None)


def _run(cfg: Config, layout: Layout, run_dir: str, denv: DistEnv, built: Built,
         meter: SavedBytesMeter) -> None:
    t, device = cfg.train, denv.device
    model, plan = built.model, built.plan
    optimizer = build_optimizer(model, cfg.optim)
    scheduler = build_scheduler(optimizer, cfg.optim, t.steps)

    train_set, val_set, _ = build_datasets(
        cfg.data.source, cfg.data.seq_len, cfg.model.vocab_size, t.seed, cfg.data.train_path,
        cfg.data.val_path, cfg.data.token_dtype, cfg.data.max_corpus_bytes)
    val_data = _to(val_batches(val_set, t.eval_batches, t.micro_batch_size, denv.rank,
                               denv.world_size), device)

    logger = _start_logging(cfg, denv, run_dir)
    if denv.is_main:
        with open(os.path.join(run_dir, "plan.json"), "w") as f:
            f.write(plan_to_json(plan))
        logger.plan(plan_table(plan, built.profiles), plan_rows(plan, built.profiles))
    num_params = sum(p.numel() for p in model.parameters())
    logger.info(f"world {denv.world_size} ({cfg.sharding.mode}, replicate {layout.replicate} x "
                f"shard {layout.shard}) on {device.type}; {num_params / 1e6:.2f}M parameters; "
                f"plan: {describe(plan)}; global batch {layout.global_batch_size} x "
                f"{cfg.data.seq_len} tokens (micro {t.micro_batch_size} x accum "
                f"{layout.grad_accum} x ranks {denv.world_size}); run dir {run_dir}")
    if t.compile:
        logger.info(f"torch.compile: compiled {built.compiled_blocks} blocks (each after its "
                    "checkpoint wrapper, before sharding)")

    flops = flops_per_token(llama_args(cfg.model), cfg.data.seq_len)
    peak = peak_flops(device)
    tokens_per_step = layout.global_batch_size * cfg.data.seq_len

    recompute_s = None
    if built.profiles is not None:  # profiled seconds the plan adds, for all micro-batches
        recompute_s = added_seconds(plan, built.profiles) * layout.grad_accum

    logger.record({"step": 0, "val_loss": evaluate(model, val_data)})
    for step in range(1, t.steps + 1):
        started = time.perf_counter()  # the step's time includes reading its batch
        micro_batches = _to(train_batch(train_set, step - 1, t.micro_batch_size, layout.grad_accum,
                                        denv.rank, denv.world_size, t.seed), device)
        lr = scheduler.get_last_lr()[0]
        loss, grad_norm = train_step(model, optimizer, scheduler, micro_batches,
                                     cfg.optim.grad_clip, meter, built.offloader)
        loss_value = mean_over_ranks(loss)  # also waits for the step to finish
        step_time = time.perf_counter() - started
        tokens_per_s = tokens_per_step / step_time
        logger.step(step, loss_value, tokens_per_s)

        if step % cfg.logging.every == 0 or step == t.steps:
            metrics = {"step": step, "loss": loss_value, "lr": lr, "grad_norm": grad_norm.item(),
                       "tokens_per_s": tokens_per_s, "step_time_s": step_time,
                       "tokens_seen": step * tokens_per_step,
                       "peak_mem_bytes": peak_memory_bytes(device),
                       "act_saved_bytes": meter.peak}
            meter.reset_peak()
            if recompute_s is not None:
                metrics["recompute_s"] = recompute_s
            if built.offloader is not None:
                metrics["offloaded_bytes"] = built.offloader.stats.offloaded_bytes
            if peak is not None:
                metrics["mfu"] = flops * tokens_per_s / (peak * denv.world_size)
            logger.record(metrics)
        if step % t.eval_every == 0 or step == t.steps:
            logger.record({"step": step, "val_loss": evaluate(model, val_data)})
    logger.close()

