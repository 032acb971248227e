"""The training run: a Trainer builds its parts once, then runs a loop whose body is one line per
part: take the batch, train the step, log, evaluate, vote, save.

Each part decides its own timing (`StepLog.should_log`, `Evaluation.should_evaluate`,
`SaveSchedule.should_save`, `StopVote.decide`), and a part that is off does nothing, so the loop
tests no settings. Ranks other than 0 hold a logger that drops what it is given, so the loop has
no rank checks either. The data is one `Data` (trainer/data/), whatever its source. Resume and
rollback live in trainer/state/, alerts and the dashboard in trainer/observe/, faults in
trainer/faults.py.
"""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import logging
import os
import time
from dataclasses import dataclass
from typing import Iterator, Optional, Sequence

import torch
import torch.distributed as dist

from checkpointing.plan import (describe, head_line, head_row, head_table_row, plan_rows,
                                plan_table, plan_to_json)
from checkpointing.planner.policies import added_seconds
from checkpointing.meter import SavedBytesMeter
from offload.apply import close_offloader, offload_micro_batch
from offload.engine import Offloader
from offload.heap import steady_thresholds
from sharding.fsdp import set_grad_sync
from trainer.build import build_model
from trainer.config import Config
from trainer.data.batches import Sampling
from trainer.data.factory import open_data
from trainer.distenv import DistEnv, init_distributed, mean_and_sums, read_env, shutdown
from trainer.faults import (CollectiveFailure, LossFn, LossGuard, PreemptionSignal, StopVote,
                            TimeoutWatchdog, Verdict, injected_loss)
from trainer.preflight.auto_plan import auto_decides, auto_rows, auto_table
from trainer.preflight.auto_run import AUTO_FILE, run_auto
from trainer.models.families import family_of
from trainer.observe.dashboard import end_of_run, start_logging, start_of_run
from trainer.observe.evaluate import Evaluation
from trainer.observe.metrics import peak_memory_bytes, run_summary, summary_fields
from trainer.observe.steplog import Gauges, StepLog, StepShape, Startup
from trainer.observe.watch import Alerts
from trainer.optim import build_optimizer, build_scheduler, clip_grad_norm
from trainer.state.checkpoint import Checkpointer, clear_stopped, mark_stopped
from trainer.state.ownership import own_run_dir
from trainer.state.resume import ModelState, Progress, RunRecord, resume
from trainer.state.rollback import Rollback
from trainer.state.save_errors import SaveFailed
from trainer.state.schedule import SaveSchedule
from trainer.task import task_for, with_head_share
from sharding.layout import Layout
from trainer.validate import model_facts

log = logging.getLogger("trainer")
INTERRUPTED_EXIT = 130  # the shell's status for a command stopped by Ctrl-C
Batch = tuple[torch.Tensor, ...]  # (inputs, targets), or packed: (inputs, targets, positions)


@dataclass(frozen=True)
class StepParts:
    """What every optimizer step uses, built once."""
    model: ModelState  # the model, its optimizer and learning-rate schedule
    grad_clip: float
    meter: SavedBytesMeter  # counts what a forward keeps on the device for backward
    offloader: Optional[Offloader]
    guard: LossGuard
    vote: Optional[StopVote] = None  # its ballot rides on the step's one all-reduce


def train_step(parts: StepParts, micro_batches: Sequence[Batch], loss_fn: LossFn,
               normaliser: Optional[int] = None) -> tuple[float, float, Verdict, list[int]]:
    """One optimizer step over this rank's micro-batches; returns (loss, grad norm, verdict,
    the stop vote's ballots summed over the ranks: read after the backward).

    loss_fn: the task's loss (trainer/task.py), or a drill's that spoils it (trainer/faults.py).
    normaliser: for a loss summed over supervised targets (packed documents), their count in
    the whole global batch, so that the loss is their mean whatever the micro-batches and
    ranks hold (gradients are averaged over ranks, hence the world size). Otherwise each
    micro-batch's mean counts 1 / its number.
    Under sharding.sequence=N a micro-batch is this rank's 1/N slice of its samples. The summed
    loss still divides by the whole global batch's count (each token once). A mean loss is the
    slice's mean, which is exact: mean-loss data (token windows) supervises every target, so
    each slice holds 1/N of its micro-batch's, and the average over all ranks of the slices'
    means is N=1's average of the samples' means (tests/test_sequence_runs.py).
    The update is applied only if the guard accepts the step; it judges the loss averaged over
    ranks and the global gradient norm, so every rank decides the same.
    """
    model, optimizer = parts.model.model, parts.model.optimizer
    world = dist.get_world_size() if dist.is_initialized() else 1
    last = len(micro_batches) - 1
    # Accumulating: the sum of the micro-batches' losses from zero. One micro-batch: its loss
    # (0 + x is x), with no ops for the sum.
    total_loss = torch.zeros((), device=micro_batches[0][0].device) if last else None
    for i, batch in enumerate(micro_batches):
        if last and i in (0, last):
            # Cross-rank reduction is deferred to the last micro-batch where that saves traffic.
            # Set where it changes only: the setter walks every module (~350 Python calls), and
            # without accumulation it stays at its default, on.
            set_grad_sync(model, i == last)
        with offload_micro_batch(parts.offloader):  # planned blocks' activations leave the device
            with parts.meter.measure():  # counts what this forward keeps on the device for backward
                loss = loss_fn(model, *batch)
                if normaliser is not None:
                    loss = loss * (world / max(normaliser, 1))
                elif last:  # x / 1 is x: one micro-batch needs no division (nor its backward)
                    loss = loss / len(micro_batches)
            loss.backward()
        if last:
            total_loss += loss.detach()
        else:
            total_loss = loss.detach()
    grad_norm = clip_grad_norm(model.parameters(), parts.grad_clip)
    # The guard needs both before the update: read together, one wait for the device.
    # (FSDP's CPU offload leaves the norm in host memory: it joins the loss on the device.)
    local_loss, norm_value = torch.stack([total_loss, grad_norm.to(total_loss.device)]).tolist()
    # One collective: the loss's mean over the ranks and the stop vote, in host memory.
    ballot = parts.vote.ballot() if parts.vote is not None else []
    loss_value, ballots = mean_and_sums(local_loss, ballot, total_loss.dtype)
    verdict = parts.guard.judge(loss_value, norm_value)
    if verdict.ok:
        optimizer.step()
        parts.model.scheduler.step()
    optimizer.zero_grad(set_to_none=True)
    return loss_value, norm_value, verdict, ballots


def step_seconds(started: float, device: torch.device, synchronize=None) -> float:
    """Seconds since `started`, once the device has finished the step: CUDA runs the optimizer
    step after the CPU has queued it, and leaving it out would read throughput and MFU high.
    One synchronisation per step; `synchronize` stands in for torch.cuda.synchronize in tests."""
    if device.type == "cuda":
        (synchronize or torch.cuda.synchronize)(device)
    return time.perf_counter() - started


@contextlib.contextmanager
def setup_frozen() -> Iterator[None]:
    """Python's collector leaves what exists now (the model, the config, imported modules: some
    300,000 objects) out of its full passes while the steps run. One such pass over them took
    0.19-0.29 s mid-run, a step twice as long as its neighbours and a false throughput alert
    (2026-12-01); after it a pass sees only what the steps keep. Unfrozen after the steps, so
    what the run leaves behind is collected as usual (a sweep runs more jobs in the process)."""
    gc.freeze()
    try:
        yield
    finally:
        gc.unfreeze()


def _to(batches: Sequence[Batch], device: torch.device) -> list[Batch]:
    return [tuple(t.to(device, non_blocking=True) for t in batch) for batch in batches]


def train(cfg: Config, layout: Layout, run_dir: str, keep_process_group: bool = False) -> int:
    """The whole run on this rank; returns the exit status (0, 130 after Ctrl-C, or
    save.preempt_exit_code). keep_process_group: more jobs follow in this process (a `-m`
    sweep); they reuse the group."""
    denv = read_env(cfg.train.device)
    if denv.device.type == "cpu" and cfg.train.cpu_heap == "steady":  # before the model exists
        log.debug("glibc's heap thresholds: %s (train.cpu_heap)", steady_thresholds())
    init_distributed(denv, cfg.train.dist_timeout_s)
    try:
        # Dropout masks differ per rank (as their data does) but repeat run to run.
        torch.manual_seed(cfg.train.seed + denv.rank)
        lock = own_run_dir(run_dir, denv.is_main, not cfg.save.resume,
                           _checkpoint_dir(cfg, run_dir))
        try:
            status = Trainer(cfg, layout, run_dir, denv).run()
        finally:
            if lock is not None:
                lock.release()
    except BaseException:
        shutdown(clean=False)
        raise
    shutdown(destroy=not keep_process_group)
    return status


def _checkpoint_dir(cfg: Config, run_dir: str) -> str:
    return cfg.save.dir or os.path.join(run_dir, "checkpoints")


class Trainer:
    """One run on one rank: `__init__` builds every part once and resumes where the run stands,
    `run()` is the step loop. The parts are whole when made, and none calls back into the
    Trainer."""

    def __init__(self, cfg: Config, layout: Layout, run_dir: str, denv: DistEnv) -> None:
        decision = None
        # The share of supervised rows the head is planned for: the prepared cache's, if any.
        cfg, self.head_note = with_head_share(cfg)
        if auto_decides(cfg, layout):  # auto decides the plan, tiles, micro-batch or degree first
            cfg, layout, decision = run_auto(cfg, layout, denv, run_dir, denv.local_world_size)
        self.cfg, self.layout, self.run_dir, self.denv = cfg, layout, run_dir, denv
        self.device, t, lg = denv.device, cfg.train, cfg.logging
        meter = SavedBytesMeter()  # what the forwards keep on the device for backward
        self.built = built = build_model(
            cfg, denv, layout, meter, run_dir,
            None if decision is None else (decision.plan, decision.profiles))
        built.decision = decision
        # What run() closes on every way out, the last made first; here if a part fails.
        self.closing = contextlib.ExitStack()
        self.closing.callback(close_offloader, built.offloader,
                              own_parent=cfg.offload.dir is None)  # joins its threads
        try:
            optimizer = build_optimizer(built.model, cfg.optim)
            self.model_state = ModelState(built.model, optimizer,
                                          build_scheduler(optimizer, cfg.optim, t.steps))
            self.task = task_for(cfg.model, cfg.data, cfg.checkpointing)
            guard = LossGuard(cfg.faults.skip_nonfinite, cfg.faults.max_bad_steps,
                              cfg.faults.spike_factor, cfg.faults.spike_window)
            self.checkpointer = Checkpointer(_checkpoint_dir(cfg, run_dir), cfg.save.keep,
                                             cfg.save.async_save, denv.rank, denv.world_size,
                                             self.device, dataclasses.asdict(cfg.model))
            self.watchdog = TimeoutWatchdog(denv.rank, t.dist_timeout_s)
            self.data = open_data(cfg.data, model_facts(cfg.model), Sampling(
                denv.rank, layout, t.seed, t.eval_batches, preparer=denv.local_rank == 0,
                local_size=denv.local_world_size),
                family_of(cfg.model).image_preprocessing(cfg.model), self.device, self.watchdog)
            self.closing.callback(self.data.close)
            # Under torchrun, a worker whose agent was killed (kill -9 leaves no one to stop
            # it) saves and stops by itself.
            self.preemption = PreemptionSignal(cfg.save.signal, announce=denv.is_main,
                                               watch_launcher="TORCHELASTIC_RUN_ID" in os.environ)
            self.closing.callback(self.preemption.restore)
            resumed = resume(self.checkpointer, self.model_state, layout, cfg, denv.rank,
                             self.data, run_dir) if cfg.save.resume else None
            self.progress = Progress() if resumed is None else resumed[0]
            self.logger = start_logging(cfg, denv, run_dir, self.progress.step)
            self.logger.start_step = self.progress.batch_index
            self.alerts = Alerts(self.logger, lg.alert_interval_s)
            predicted = start_of_run(self.logger, cfg, built, layout, denv, run_dir, resumed,
                                     self.alerts)
            self._announce()
            if self.head_note is not None:
                self.logger.info(f"head: {cfg.checkpointing.head}, {self.head_note}")
            self.steplog = StepLog(lg, t.steps, self.logger, self.alerts, self._shape(),
                                   Gauges(self.device, meter, built.offloader),
                                   Startup(built.build_s, built.started, built.compiled_blocks,
                                           self.progress.step), predicted)
            self.evaluation = Evaluation(t, resumed is None, built.model, self.data.val,
                                         self.task, self.device, self.logger,
                                         self.data.val_weights)
            if resumed is not None:
                self.logger.info(resumed[1])
            self.rollback = Rollback(self.checkpointer, self.model_state, guard, self.logger,
                                     self.alerts, cfg.faults.max_rollbacks)
            self.saves = SaveSchedule(cfg.save, t.steps, self.checkpointer, self.watchdog,
                                      RunRecord(layout, cfg, run_dir, self.data))
            self.stops = StopVote(self.preemption, self.checkpointer, t.stop_at_step, t.steps)
            self.step_parts = StepParts(self.model_state, cfg.optim.grad_clip, meter,
                                        built.offloader, guard, self.stops)
            self.run_started, self.first_step = time.monotonic(), self.progress.step
        except BaseException:
            self.closing.close()
            raise

    def _loss_for(self, batch_index: int) -> LossFn:
        """The task's loss, or a fault injected for tests and drills (faults.inject_*)."""
        f, t = self.cfg.faults, self.cfg.train
        return injected_loss(self.task.loss, batch_index, f.inject_nan_at, f.inject_spike_at,
                             f.inject_hang_at, 2.0 * t.dist_timeout_s, self.denv.rank,
                             self.denv.world_size, f.inject_slow_at, f.inject_slow_s)

    def run(self) -> int:
        """Evaluate at step 0 if asked, run the steps, end; returns the exit status. The parts
        close on every way out."""
        with self.closing:
            self.evaluation.start()
            self.run_started = time.monotonic()
            try:
                with setup_frozen():
                    status = self._steps()
            except CollectiveFailure as failure:  # the watchdog named it: alert, then leave
                self.alerts.fire("collective_timeout", self.progress.step + 1, str(failure),
                                 "ERROR", self.progress.batch_index)
                raise
            except SaveFailed:
                if self.preemption.at_once:  # the second Ctrl-C broke the save (faults.py)
                    raise KeyboardInterrupt from None
                raise
            self.checkpointer.close()  # an async save still being written is committed first
            return status

    def _steps(self) -> int:
        """The step loop: one line per part, each deciding for itself whether it acts."""
        while self.progress.step < self.cfg.train.steps:
            step, index = self.progress.step + 1, self.progress.batch_index
            started = time.perf_counter()  # the step's time includes reading its batch
            batch, counts = self.data.batch(index)  # counts: the step's tokens, where counted
            micro_batches = _to(batch, self.device)
            data_wait_s = time.perf_counter() - started  # ~0 when the batch was read ahead
            loss_fn = self._loss_for(index)  # faults.inject_*: a drill may slow or spoil it
            lr = self.model_state.scheduler.get_last_lr()[0]
            with self.watchdog(f"step {step} (forward, backward, gradient reduction)"), \
                    self.steplog.measuring(step, self.model_state, micro_batches, index):
                loss, grad_norm, verdict, ballots = train_step(
                    self.step_parts, micro_batches, loss_fn, counts and counts[0])
            self.progress.batch_index += 1
            if not verdict.ok:
                self.progress = self.rollback.after_bad_step(verdict, step, self.progress)
                continue
            self.progress.step = step
            self.progress.tokens_seen += self.steplog.tokens_of(counts)
            self.steplog.step(step, loss, grad_norm, lr, step_seconds(started, self.device),
                              data_wait_s, self.progress.tokens_seen, index + 1, counts)
            self.evaluation.maybe(step, index + 1)
            with self.watchdog(f"the end of step {step} (an async save's commit)"):
                stop_reason = self.stops.decide(step, ballots)
            self.saves.save(step, stop_reason is not None, self.model_state, self.progress)
            if stop_reason is not None:
                return self._stop(step, stop_reason)
        return self._finish()

    def _shape(self) -> StepShape:
        built, layout = self.built, self.layout
        recompute_s = None
        if built.profiles is not None and all(p.recompute in built.profiles[p.index].cost_s
                                              for p in built.plan):  # profiled seconds it adds
            recompute_s = added_seconds(built.plan, built.profiles) * layout.grad_accum
        return StepShape(layout.global_batch_size * self.task.tokens_per_sample,
                         layout.global_batch_size, self.denv.world_size,
                         built.flops_per_token, recompute_s)

    def _announce(self) -> None:
        """The plan (plan.json, a table, W&B), what auto decided, and one line on the run."""
        cfg, denv, built, layout = self.cfg, self.denv, self.built, self.layout
        plan = built.plan
        head = head_row(cfg.checkpointing.head, self.task.head_chunk)
        if denv.is_main:
            with open(os.path.join(self.run_dir, "plan.json"), "w") as f_plan:
                f_plan.write(plan_to_json(plan, head))
        rows = plan_rows(plan, built.profiles)
        self.logger.plan(plan_table(plan, built.profiles) + "\n" + head_line(head),
                         rows + [head_table_row(head, rows[0], len(plan))])
        d = built.decision
        if d is not None:
            when = "as decided at the first start: " if d.reused else "saved in "
            self.logger.table(
                "auto_candidates", f"auto within {d.capacity / 2**30:.2f} GiB per rank: "
                f"micro-batch {d.micro_batch}, predicted peak {d.peak_bytes / 2**30:.3f} GiB, step "
                f"{d.step_s:.4f} s ({when}{AUTO_FILE}); candidates", auto_table(d), auto_rows(d))
        num_params = sum(p.numel() for p in self.model_state.model.parameters())
        trained = sum(p.numel() for p in self.model_state.model.parameters() if p.requires_grad)
        trained_note = "" if trained == num_params else f" ({trained / 1e6:.3f}M trained)"
        self.logger.info(
            f"world {denv.world_size} ({layout.mode}, replicate {layout.replicate} x shard "
            f"{layout.shard}) on {self.device.type}; {num_params / 1e6:.2f}M parameters{trained_note}; plan: "
            f"{describe(plan)}; global batch {layout.global_batch_size} x "
            f"{self.task.tokens_per_sample} tokens (micro {layout.micro_batch_size} x accum "
            f"{layout.grad_accum} x {layout.readers()}); run dir {self.run_dir}")

    def _stop(self, step: int, reason: str) -> int:
        """After the save of a stopping step: the exit status, and a marker a launcher reads."""
        by_hand = reason == "SIGINT"  # Ctrl-C: no launcher should start it again
        code = self.cfg.save.preempt_exit_code
        status = INTERRUPTED_EXIT if by_hand else code
        if self.denv.is_main and not by_hand:  # before the ranks leave: a launcher may act
            mark_stopped(self.run_dir, step, reason, code)
            self.alerts.fire("preemption", step, f"stopped by {reason}: saved step {step}, "
                             f"exiting {status} for a requeue",
                             wandb_step=self.progress.batch_index)
        self.logger.info(f"stopping ({'Ctrl-C' if by_hand else reason}): saved step {step}; "
                         f"exiting with status {status} (start the same run again to continue)")
        self._summary()
        return status

    def _finish(self) -> int:
        if self.denv.is_main:
            clear_stopped(self.run_dir)  # a marker of an earlier stop of this run is stale now
        self._summary()
        return 0

    def _summary(self) -> None:
        last, path = self.saves.last()
        seconds, peak_bytes = time.monotonic() - self.run_started, peak_memory_bytes(self.device)
        self.logger.summary(run_summary(seconds, self.first_step, self.progress,
                                        self.cfg.train.steps, peak_bytes, self.device.type,
                                        self.logger.last, path))
        end_of_run(self.logger, summary_fields(self.logger, self.progress, seconds, peak_bytes),
                   path, last or 0, self.cfg.logging.wandb_checkpoint_refs, self.alerts)
        self.logger.close()
