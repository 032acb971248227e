"""What the run says about each step: every step the progress bar and the throughput watch,
once the cost of starting, and every `logging.every` steps (and at the last) the full record,
checked against the predicted memory. What the record measures costs only on its own steps: the
saved-bytes meter counts those steps alone, and one live-bytes count runs on a chosen step
(`logging.live_bytes_step`, or step 2 on CPU when memory was predicted).

Every rank keeps a StepLog; on ranks other than 0 its logger drops what it is given."""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass
from typing import Iterator, Optional, Sequence

import torch
from torch import nn

from checkpointing.meter import SavedBytesMeter
from offload.engine import Offloader
from trainer.config import LoggingConfig
from trainer.observe.dashboard import watch_memory
from trainer.observe.livebytes import step_tracker
from trainer.observe.metrics import (RunLogger, device_used_bytes, peak_flops, peak_memory_bytes,
                                     peak_reserved_bytes, startup_fields, startup_line)
from trainer.observe.watch import Alerts, ThroughputWatch
from trainer.state.resume import ModelState


@dataclass(frozen=True)
class StepShape:
    """What one optimizer step is, for throughput and MFU."""
    tokens: int  # global batch x tokens per sample
    samples: int  # global batch
    world_size: int
    flops_per_token: float
    recompute_s: Optional[float] = None  # profiled seconds the plan adds per step


@dataclass(frozen=True)
class Startup:
    """What building cost, for the start-up line after the first step."""
    build_s: float
    build_started: float  # time.perf_counter() at the start of the build
    compiled_blocks: int
    first_step: int  # the step this start continues from (0 for a fresh run)


@dataclass(frozen=True)
class Gauges:
    """Where this rank's step measures come from."""
    device: torch.device
    meter: SavedBytesMeter  # activation bytes saved for backward
    offloader: Optional[Offloader]  # bytes offloaded (None: no offload)


class StepLog:
    """Built from the logging section: `every`, the throughput and memory alerts, and the
    step whose live tensor bytes are counted (`live_bytes_step`, or on CPU the second step
    of this start when memory was predicted: `predicted`, peak bytes per rank)."""

    def __init__(self, lg: LoggingConfig, steps: int, logger: RunLogger, alerts: Alerts,
                 shape: StepShape, gauges: Gauges, startup: Startup,
                 predicted: Optional[int]) -> None:
        self.logger, self.alerts, self.shape, self.startup = logger, alerts, shape, startup
        self.every, self.steps, self.first_step = lg.every, steps, startup.first_step
        self.device, self.meter, self.offloader = gauges.device, gauges.meter, gauges.offloader
        self.throughput = ThroughputWatch(lg.alert_throughput_fraction,
                                          lg.alert_throughput_window)
        self.predicted, self.margin = predicted, lg.alert_memory_margin
        # On CPU the prediction is checked against live tensor bytes (RSS includes the
        # interpreter).
        self.live_step = lg.live_bytes_step or (
            self.first_step + 2 if predicted and self.device.type == "cpu" else None)
        self.peak_flops = peak_flops(self.device)
        self._startup: dict = {}  # logged with the first step's record
        self._counted_step: Optional[int] = None

    def should_log(self, step: int) -> bool:
        return step % self.every == 0 or step == self.steps

    def measuring(self, step: int, model: ModelState, micro_batches: Sequence,
                  wandb_step: int) -> contextlib.AbstractContextManager:
        """Around the training step: the saved-bytes meter counts only on a step whose record
        is logged (act_saved_bytes is that step's; the shapes, and so the bytes, are the same
        every step); on the chosen step, the peak of live tensor bytes is counted and recorded
        (the memory model's check on CPU). Other steps pay for neither."""
        self.meter.enabled = self.should_log(step)
        if step != self.live_step:
            return contextlib.nullcontext()
        return self._count_live_bytes(step, model.model, model.optimizer, micro_batches,
                                      wandb_step)

    @contextlib.contextmanager
    def _count_live_bytes(self, step: int, model: nn.Module, optimizer: torch.optim.Optimizer,
                          micro_batches: Sequence, wandb_step: int) -> Iterator[None]:
        live = step_tracker(True, model, optimizer, list(micro_batches))
        with live:
            yield
        self._counted_step = step  # counting slows the step: no throughput verdict on it
        record = {"step": step, "live_peak_bytes": live.peak}
        self.logger.record(record, console=False)
        watch_memory(self.logger, self.alerts, self.predicted, record, self.margin, wandb_step)

    def tokens_of(self, counts: Optional[tuple[int, int]]) -> int:
        """The step's tokens: real ones (not padding) where the data counts them."""
        return self.shape.tokens if counts is None else counts[1]

    def step(self, step: int, loss: float, grad_norm: float, lr: float,
             step_time: float, data_wait_s: float, tokens_seen: int, wandb_step: int,
             counts: Optional[tuple[int, int]] = None) -> None:
        """After a step that was applied; counts: (supervised, real) tokens of packed data."""
        tokens_per_s = self.tokens_of(counts) / step_time
        self.logger.step(step, loss, tokens_per_s)
        drift = None if self._counted_step == step else self.throughput.check(tokens_per_s)
        if drift:
            self.alerts.fire("throughput", step, drift, wandb_step=wandb_step)
        if step == self.first_step + 1:  # the cost of starting: building, compiling, first step
            s = self.startup
            self._startup = startup_fields(s.build_s, step_time,
                                           time.perf_counter() - s.build_started,
                                           s.compiled_blocks)
            self.logger.info(startup_line(self._startup, s.compiled_blocks))
        if self.should_log(step):
            metrics = {"step": step, "loss": loss, "lr": lr, "grad_norm": grad_norm,
                       "tokens_per_s": tokens_per_s, "step_time_s": step_time,
                       "samples_per_s": self.shape.samples / step_time,
                       "data_wait_s": data_wait_s, "tokens_seen": tokens_seen,
                       "peak_mem_bytes": peak_memory_bytes(self.device),
                       "act_saved_bytes": self.meter.peak, **self._startup, **self._extra(
                           tokens_per_s, counts)}
            self.meter.reset_peak()
            self._startup = {}
            self.logger.record(metrics, wandb_step=wandb_step)
            watch_memory(self.logger, self.alerts, self.predicted, metrics, self.margin,
                         wandb_step)

    def _extra(self, tokens_per_s: float, counts: Optional[tuple[int, int]]) -> dict:
        """The fields that exist only for some runs: packed data's supervised tokens and
        packing efficiency, planned recompute, offload, CUDA memory and MFU."""
        extra = {}
        if counts is not None:
            # How full the windows are (real tokens over capacity), and how much of what
            # fills them is learned: two questions, two numbers.
            extra["supervised_tokens"] = counts[0]
            extra["packing_efficiency"] = counts[1] / self.shape.tokens
            extra["supervised_fraction"] = counts[0] / max(1, counts[1])
        if self.shape.recompute_s is not None:
            extra["recompute_s"] = self.shape.recompute_s
        if self.offloader is not None:
            extra["offloaded_bytes"] = self.offloader.stats.offloaded_bytes
        if self.device.type == "cuda":
            extra["peak_reserved_bytes"] = peak_reserved_bytes(self.device)
            extra["device_used_bytes"] = device_used_bytes(self.device)
        if self.peak_flops is not None:
            extra["mfu"] = (self.shape.flops_per_token * tokens_per_s
                            / (self.peak_flops * self.shape.world_size))
        return extra
