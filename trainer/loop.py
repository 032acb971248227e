"""The training run: set up once, then a loop whose step reads top to bottom.

Eval, logging and state saving sit outside `train_step` behind "every N steps" guards; resume,
rollback and fault handling live in trainer/state/resume.py, trainer/state/checkpoint.py and trainer/faults.py;
alerts in trainer/observe/watch.py, what W&B shows beyond the metrics in trainer/observe/dashboard.py.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import os
import time
from typing import Callable, Iterator, Optional, Sequence

import torch
import torch.distributed as dist
from torch import nn

from checkpointing.plan import describe, plan_rows, plan_table, plan_to_json
from checkpointing.policies import added_seconds
from checkpointing.saved import SavedBytesMeter
from offload.apply import close_offloader, offload_micro_batch
from offload.engine import Offloader
from trainer.distenv import DistEnv, init_distributed, read_env, shutdown
from sharding.fsdp import reshard_all, set_grad_sync
from trainer.fit.autofit import fitting, rows as fit_rows, table as fit_table
from trainer.build import Built, build_model
from trainer.fit.fitrun import DECISION_FILE as FIT_FILE, fit_run
from trainer.config import Config
from trainer.validate import Layout
from trainer.models.hf_settings import model_vocab_size
from trainer.observe.livebytes import step_tracker
from trainer.data.tokens import train_batch, val_batches
from trainer.models.llama import lm_loss
from trainer.data.prefetch import Prefetcher
from trainer.task import Task, build_task_datasets, task_for
from trainer.faults import (CollectiveFailure, LossFn, LossGuard, PreemptionSignal, Verdict,
                            injected_loss, is_collective_failure, name_failure, step_vote)
from trainer.observe.dashboard import end_of_run, start_logging, start_of_run, watch_memory
from trainer.observe.watch import Alerts, ThroughputWatch, bad_step
from trainer.observe.metrics import (device_used_bytes, peak_flops, peak_memory_bytes,
                             peak_reserved_bytes, run_summary, startup_fields, startup_line,
                             summary_fields)
from trainer.optim import build_optimizer, build_scheduler, clip_grad_norm
from trainer.state.ownership import RunDirBusy, RunLock, set_aside
from trainer.state.resume import Progress, resume, train_state
from trainer.state.checkpoint import Checkpointer, checkpoint_path, clear_stopped, mark_stopped

log = logging.getLogger("trainer")
INTERRUPTED_EXIT = 130  # the shell's status for a command stopped by Ctrl-C
Batch = tuple[torch.Tensor, torch.Tensor]


def train_step(model: nn.Module, optimizer: torch.optim.Optimizer, scheduler,
               micro_batches: Sequence[Batch], grad_clip: float, meter: SavedBytesMeter,
               offloader: Optional[Offloader], guard: LossGuard,
               loss_fn: LossFn = lm_loss) -> tuple[float, torch.Tensor, Verdict]:
    """One optimizer step over this rank's micro-batches; returns (loss, grad norm, verdict).

    The update is applied only if the guard accepts the step; it judges the loss averaged over
    ranks and the global gradient norm, so every rank decides the same.
    """
    total_loss = torch.zeros((), device=micro_batches[0][0].device)
    for i, (inputs, targets) in enumerate(micro_batches):
        # Cross-rank reduction is deferred to the last micro-batch where that saves traffic.
        set_grad_sync(model, i == len(micro_batches) - 1)
        with offload_micro_batch(offloader):  # planned blocks' activations leave the device
            with meter.measure():  # counts what this forward keeps on the device for backward
                loss = loss_fn(model, inputs, targets) / len(micro_batches)
            loss.backward()
        total_loss += loss.detach()
    grad_norm = clip_grad_norm(model.parameters(), grad_clip)
    loss_value = mean_over_ranks(total_loss)
    verdict = guard.judge(loss_value, grad_norm.item())
    if verdict.ok:
        optimizer.step()
        scheduler.step()
    optimizer.zero_grad(set_to_none=True)
    return loss_value, grad_norm, verdict


def mean_over_ranks(value: torch.Tensor) -> float:
    if dist.is_initialized() and dist.get_world_size() > 1:
        value = value.clone()
        dist.all_reduce(value)  # gloo has no AVG: sum, then divide
        value /= dist.get_world_size()
    return value.item()


@torch.no_grad()
def evaluate(model: nn.Module, batches: Sequence[Batch], task: Task,
             device: torch.device) -> dict[str, float]:
    """val_loss, and val_accuracy (top-1) for classification, over every rank's batches.
    The batches wait in host memory (high-resolution images are large) and visit the device
    one at a time."""
    model.eval()
    loss = torch.zeros((), device=device)
    correct = torch.zeros_like(loss)
    for inputs, targets in batches:
        batch_loss, batch_correct = task.eval_batch(model, inputs.to(device), targets.to(device))
        loss += batch_loss
        correct += batch_correct
    reshard_all(model)
    model.train()
    metrics = {"val_loss": mean_over_ranks(loss / len(batches))}
    if task.kind == "classification":
        metrics["val_accuracy"] = mean_over_ranks(correct / len(batches))
    return metrics


def _to(batches: Sequence[Batch], device: torch.device) -> list[Batch]:
    return [(x.to(device, non_blocking=True), y.to(device, non_blocking=True)) for x, y in batches]


def train(cfg: Config, layout: Layout, run_dir: str, keep_process_group: bool = False) -> int:
    """The whole run on this rank; returns the exit status (0, or save.preempt_exit_code).

    keep_process_group: more jobs follow in this process (a `-m` sweep); they reuse the group.
    """
    denv = read_env(cfg.train.device)
    init_distributed(denv, cfg.train.dist_timeout_s)
    try:
        status = _train(cfg, layout, run_dir, denv)
    except BaseException:
        shutdown(clean=False)
        raise
    shutdown(destroy=not keep_process_group)
    return status


@contextlib.contextmanager
def _collectives(rank: int, operation: str, timeout_s: int,
                 alert: Optional[Callable[[str], object]] = None) -> Iterator[None]:
    """A timed-out or broken collective inside says which rank and which operation (and
    `alert` hears it first)."""
    try:
        yield
    except CollectiveFailure:
        raise
    except Exception as error:
        if is_collective_failure(error):
            failure = name_failure(error, rank, operation, timeout_s)
            if alert is not None:
                alert(str(failure))
            raise failure from error
        raise


def _own_run_dir(cfg: Config, run_dir: str, denv: DistEnv) -> Optional[RunLock]:
    """Rank 0 locks the run directory (every rank learns whether it could) and, for a fresh
    start in a directory with a history, sets that history aside."""
    lock, outcome = None, [None]
    if denv.is_main:
        lock = RunLock(run_dir)
        try:
            lock.acquire()
            if not cfg.save.resume:
                moved = set_aside(run_dir, cfg.save.dir or os.path.join(run_dir, "checkpoints"))
                if moved:
                    log.warning("save.resume=false: starting over; the earlier checkpoints and "
                                "metrics of this run directory were moved to %s",
                                " and ".join(moved))
        except RunDirBusy as exc:
            outcome = [str(exc)]
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.broadcast_object_list(outcome, src=0)
    if outcome[0] is not None:
        raise RunDirBusy(outcome[0])
    return lock


def _train(cfg: Config, layout: Layout, run_dir: str, denv: DistEnv) -> int:
    # Dropout masks differ per rank (as their data does) but repeat run to run.
    torch.manual_seed(cfg.train.seed + denv.rank)
    lock = _own_run_dir(cfg, run_dir, denv)
    try:
        return _train_owned(cfg, layout, run_dir, denv)
    finally:
        if lock is not None:
            lock.release()


def _train_owned(cfg: Config, layout: Layout, run_dir: str, denv: DistEnv) -> int:
    decision = None
    if fitting(cfg):  # checkpointing=auto or micro_batch_size=auto: decide, then build as usual
        cfg, layout, decision = fit_run(cfg, layout, denv, run_dir, denv.local_world_size)
    t, device = cfg.train, denv.device
    meter = SavedBytesMeter()
    built = build_model(cfg, denv, layout.replicate, meter, run_dir,
                        None if decision is None else (decision.plan, decision.profiles))
    built.decision = decision
    checkpointer = Checkpointer(cfg.save.dir or os.path.join(run_dir, "checkpoints"),
                                cfg.save.keep, cfg.save.async_save, denv.rank, denv.world_size,
                                device, dataclasses.asdict(cfg.model))
    train_set, val_set = build_task_datasets(cfg.model, cfg.data, model_vocab_size(cfg.model),
                                             t.seed)
    batches = Prefetcher(lambda index: train_batch(train_set, index, t.micro_batch_size,
                                                   layout.grad_accum, denv.rank,
                                                   denv.world_size, t.seed), cfg.data.workers)
    val_data = val_batches(val_set, t.eval_batches, t.micro_batch_size, denv.rank,
                           denv.world_size)
    # Under torchrun, a worker whose agent was killed (kill -9 leaves no one to stop it) saves
    # and stops by itself.
    preemption = PreemptionSignal(cfg.save.signal, announce=denv.is_main,
                                  watch_launcher="TORCHELASTIC_RUN_ID" in os.environ)
    try:
        status = _run(cfg, layout, run_dir, denv, built, meter, checkpointer, preemption,
                      batches, val_data)
        checkpointer.close()  # an async save still being written is committed before exit
        return status
    finally:
        preemption.restore()
        batches.close()
        # Joins its threads; no file outlives the run, also when it failed.
        close_offloader(built.offloader, own_parent=cfg.offload.dir is None)


def _run(cfg: Config, layout: Layout, run_dir: str, denv: DistEnv, built: Built,
         meter: SavedBytesMeter, checkpointer: Checkpointer, preemption: PreemptionSignal,
         batches: Prefetcher[list[Batch]], val_data: list[Batch]) -> int:
    t, f, device = cfg.train, cfg.faults, denv.device
    model, plan = built.model, built.plan
    optimizer = build_optimizer(model, cfg.optim)
    scheduler = build_scheduler(optimizer, cfg.optim, t.steps)
    task = task_for(cfg.model, cfg.data)

    progress, resumed = Progress(), None
    if cfg.save.resume:
        resumed = resume(checkpointer, model, optimizer, scheduler, layout, cfg, denv.rank)
        if resumed is not None:
            progress = resumed[0]
    logger = start_logging(cfg, denv, run_dir, progress.step)
    logger.start_step = progress.batch_index
    lg = cfg.logging
    alerts = Alerts(logger, lg.alert_interval_s)
    throughput = ThroughputWatch(lg.alert_throughput_fraction, lg.alert_throughput_window)
    predicted = start_of_run(logger, cfg, built, layout, denv, run_dir, resumed, alerts)
    # On CPU the prediction is checked against live tensor bytes (RSS includes the interpreter).
    live_step = lg.live_bytes_step or (progress.step + 2 if predicted and device.type == "cpu"
                                       else None)

    def timed_out(text: str) -> None:
        alerts.fire("collective_timeout", progress.step + 1, text, "ERROR", progress.batch_index)
    if denv.is_main:
        with open(os.path.join(run_dir, "plan.json"), "w") as f_plan:
            f_plan.write(plan_to_json(plan))
        logger.plan(plan_table(plan, built.profiles), plan_rows(plan, built.profiles))
        if built.decision is not None:
            d = built.decision
            logger.table("auto_candidates", f"fitting {d.capacity / 2**30:.2f} GiB per rank: "
                         f"micro-batch {d.micro_batch}, predicted peak "
                         f"{d.peak_bytes / 2**30:.3f} GiB, step {d.step_s:.4f} s ("
                         f"{'as decided at the first start: ' if d.reused else 'saved in '}"
                         f"{FIT_FILE}); candidates", fit_table(d), fit_rows(d))
    num_params = sum(p.numel() for p in model.parameters())
    logger.info(f"world {denv.world_size} ({cfg.sharding.mode}, replicate {layout.replicate} x "
                f"shard {layout.shard}) on {device.type}; {num_params / 1e6:.2f}M parameters; "
                f"plan: {describe(plan)}; global batch {layout.global_batch_size} x "
                f"{task.tokens_per_sample} tokens (micro {t.micro_batch_size} x accum "
                f"{layout.grad_accum} x ranks {denv.world_size}); run dir {run_dir}")

    flops = built.flops_per_token
    peak = peak_flops(device)
    tokens_per_step = layout.global_batch_size * task.tokens_per_sample

    recompute_s = None
    if built.profiles is not None and all(p.recompute in built.profiles[p.index].cost_s
                                          for p in plan):  # profiled seconds the plan adds
        recompute_s = added_seconds(plan, built.profiles) * layout.grad_accum

    def save(step: int) -> None:
        with _collectives(denv.rank, f"saving the checkpoint of step {step}", t.dist_timeout_s,
                          timed_out):
            checkpointer.save(step, model, optimizer,
                              train_state(progress, scheduler, layout, cfg, run_dir))

    if resumed is not None:
        logger.info(resumed[1])
    else:
        logger.record({"step": 0, **evaluate(model, val_data, task, device)})
    run_started, first_step = time.monotonic(), progress.step

    def summary() -> None:
        last = checkpointer.last_committed
        path = None if last is None else checkpoint_path(checkpointer.root, last)
        seconds, peak_bytes = time.monotonic() - run_started, peak_memory_bytes(device)
        logger.summary(run_summary(seconds, first_step, progress, t.steps, peak_bytes,
                                   device.type, logger.last, path))
        end_of_run(logger, summary_fields(logger, progress, seconds, peak_bytes), path,
                   last or 0, lg.wandb_checkpoint_refs, alerts)
    startup: dict = {}  # logged with the first step's record
    guard = LossGuard(f.skip_nonfinite, f.max_bad_steps, f.spike_factor, f.spike_window)
    while progress.step < t.steps:
        step = progress.step + 1
        started = time.perf_counter()  # the step's time includes reading its batch
        micro_batches = _to(batches.get(progress.batch_index), device)
        data_wait_s = time.perf_counter() - started  # ~0 when the batch was read ahead
        loss_fn = injected_loss(task.loss, progress.batch_index, f.inject_nan_at,
                                f.inject_spike_at, f.inject_hang_at, 2.0 * t.dist_timeout_s,
                                denv.rank, denv.world_size, f.inject_slow_at, f.inject_slow_s)
        lr = scheduler.get_last_lr()[0]
        live = step_tracker(step == live_step, model, optimizer, micro_batches)
        with _collectives(denv.rank, f"step {step} (forward, backward, gradient reduction)",
                          t.dist_timeout_s, timed_out), live or contextlib.nullcontext():
            loss, grad_norm, verdict = train_step(model, optimizer, scheduler, micro_batches,
                                                  cfg.optim.grad_clip, meter, built.offloader,
                                                  guard, loss_fn)
        if live is not None:
            logger.record({"step": step, "live_peak_bytes": live.peak}, console=False)
            watch_memory(logger, alerts, predicted, {"step": step, "live_peak_bytes": live.peak},
                         lg.alert_memory_margin, progress.batch_index)
        progress.batch_index += 1
        if not verdict.ok:
            progress = bad_step(verdict, step, progress, checkpointer, model, optimizer,
                                scheduler, guard, logger, alerts, f.max_rollbacks)
            continue
        progress.step, progress.tokens_seen = step, progress.tokens_seen + tokens_per_step
        step_time = time.perf_counter() - started
        tokens_per_s = tokens_per_step / step_time
        logger.step(step, loss, tokens_per_s)
        drift = None if live is not None else throughput.check(tokens_per_s)  # live: slowed
        if drift:
            alerts.fire("throughput", step, drift, wandb_step=progress.batch_index)
        if step == first_step + 1:  # the cost of starting: building, compiling, first step
            startup = startup_fields(built.build_s, step_time,
                                     time.perf_counter() - built.started, built.compiled_blocks)
            logger.info(startup_line(startup, built.compiled_blocks))

        if step % cfg.logging.every == 0 or step == t.steps:
            metrics = {"step": step, "loss": loss, "lr": lr, "grad_norm": grad_norm.item(),
                       "tokens_per_s": tokens_per_s, "step_time_s": step_time,
                       "samples_per_s": layout.global_batch_size / step_time,
                       "data_wait_s": data_wait_s,
                       "tokens_seen": progress.tokens_seen,
                       "peak_mem_bytes": peak_memory_bytes(device),
                       "act_saved_bytes": meter.peak, **startup}
            meter.reset_peak()
            startup = {}
            if recompute_s is not None:
                metrics["recompute_s"] = recompute_s
            if built.offloader is not None:
                metrics["offloaded_bytes"] = built.offloader.stats.offloaded_bytes
            if device.type == "cuda":
                metrics["peak_reserved_bytes"] = peak_reserved_bytes(device)
                metrics["device_used_bytes"] = device_used_bytes(device)
            if peak is not None:
                metrics["mfu"] = flops * tokens_per_s / (peak * denv.world_size)
            logger.record(metrics, wandb_step=progress.batch_index)
            watch_memory(logger, alerts, predicted, metrics, lg.alert_memory_margin,
                         progress.batch_index)
        if step % t.eval_every == 0 or step == t.steps:
            logger.record({"step": step, **evaluate(model, val_data, task, device)},
                          wandb_step=progress.batch_index)
        with _collectives(denv.rank, f"the end-of-step vote of step {step}", t.dist_timeout_s,
                          timed_out):
            stop, saved = step_vote([preemption.received is not None, checkpointer.local_done()],
                                    device)
            checkpointer.poll(saved)
        stop_reason = preemption.received or ("another rank's signal" if stop else None)
        if step == t.stop_at_step and step < t.steps:
            stop, stop_reason = True, "train.stop_at_step"

        every = cfg.save.every and step % cfg.save.every == 0
        if stop or every or (step == t.steps and cfg.save.at_end):
            save(step)
        if stop:
            checkpointer.wait()
            by_hand = stop_reason == "SIGINT"  # Ctrl-C: no launcher should start it again
            status = INTERRUPTED_EXIT if by_hand else cfg.save.preempt_exit_code
            if denv.is_main and not by_hand:  # before the ranks leave: a launcher may act
                mark_stopped(run_dir, step, stop_reason, cfg.save.preempt_exit_code)
                alerts.fire("preemption", step, f"stopped by {stop_reason}: saved step {step}, "
                            f"exiting {status} for a requeue", wandb_step=progress.batch_index)
            logger.info(f"stopping ({'Ctrl-C' if by_hand else stop_reason}): saved step "
                        f"{step}; exiting with status {status} "
                        "(start the same run again to continue)")
            summary()
            logger.close()
            return status
    if denv.is_main:
        clear_stopped(run_dir)  # a marker of an earlier stop of this run is stale now
    summary()
    logger.close()
    return 0
