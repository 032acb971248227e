"""What a run reports: metrics.jsonl, a console line every N steps, a progress bar, W&B.

Only rank 0 constructs a RunLogger with outputs; other ranks get one that drops everything, so
the training loop has no rank checks of its own.
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import os
import resource
from typing import Optional

import torch

log = logging.getLogger("trainer")

# Dense bf16 peak FLOP/s per device (vendor data sheets), keyed by a substring of the CUDA
# device name; the first key found wins, so a variant comes before the name it contains
# ("NVIDIA H200 NVL" is not an H200 SXM). MFU is reported only for devices listed here.
PEAK_BF16_FLOPS = {
    "H200 NVL": 835e12,
    "H100 NVL": 835e12,
    "H100 PCIe": 756e12,
    "H200": 989e12,
    "H100": 989e12,
    "H800": 989e12,
    "A100": 312e12,
    "A800": 312e12,
    "L40S": 362e12,
    "A10G": 125e12,
    "4090": 165e12,
    "V100": 125e12,
}


def peak_flops(device: torch.device) -> Optional[float]:
    if device.type != "cuda":
        return None
    return peak_flops_of(torch.cuda.get_device_name(device))


def peak_flops_of(device_name: str) -> Optional[float]:
    """The dense bf16 peak of a CUDA device by its name (None when not listed)."""
    return next((flops for key, flops in PEAK_BF16_FLOPS.items() if key in device_name), None)


def peak_memory_bytes(device: torch.device) -> int:
    """CUDA: the most bytes allocated so far; CPU: this process's peak resident set size."""
    if device.type == "cuda":
        return int(torch.cuda.max_memory_allocated(device))
    return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024  # Linux reports KiB


def peak_reserved_bytes(device: torch.device) -> Optional[int]:
    """CUDA: the most bytes the caching allocator held from the driver (allocated + cached)."""
    if device.type == "cuda":
        return int(torch.cuda.max_memory_reserved(device))
    return None


def device_used_bytes(device: torch.device) -> Optional[int]:
    """CUDA: what the whole device has in use now (this process's allocator and context, NCCL,
    and any other process): what train.memory_reserve_gib must leave room for beyond tensors."""
    if device.type == "cuda":
        free, total = torch.cuda.mem_get_info(device)
        return int(total - free)
    return None


METRICS = "metrics.jsonl"
SUPERSEDED = "metrics.superseded.jsonl"


def _is_measurement(record: dict) -> bool:
    """A step's values (which a replay records again), not an event (an alert, a skipped step,
    a rollback: those happened, and stay)."""
    return "loss" in record or "val_loss" in record


def set_aside_replayed(run_dir: str, through_step: int) -> Optional[str]:
    """Move the measurements of steps after `through_step` from metrics.jsonl to the end of
    metrics.superseded.jsonl: the run is about to record those steps again, and a step keeps
    one record. Returns what was done, in a line (None when nothing was superseded)."""
    path = os.path.join(run_dir, METRICS)
    try:
        with open(path) as f:
            lines = f.readlines()
    except FileNotFoundError:
        return None
    kept, superseded = [], []
    for line in lines:
        try:
            record = json.loads(line)
        except ValueError:  # a line cut by a kill: nothing to keep
            superseded.append(line if line.endswith("\n") else line + "\n")
            continue
        later = record.get("step", -1) > through_step and _is_measurement(record)
        (superseded if later else kept).append(line)
    if not superseded:
        return None
    with open(os.path.join(run_dir, SUPERSEDED), "a") as f:
        f.writelines(superseded)
    with open(path + ".tmp", "w") as f:
        f.writelines(kept)
    os.replace(path + ".tmp", path)
    steps = sorted({json.loads(line).get("step", -1) for line in superseded if _parses(line)})
    span = f"steps {steps[0]}-{steps[-1]}" if steps else "a cut line"
    return (f"{METRICS}: the records of {span}, from before this start, were moved to "
            f"{SUPERSEDED}; those steps run again and are recorded once")


def _parses(line: str) -> bool:
    try:
        json.loads(line)
        return True
    except ValueError:
        return False


class RunLogger:
    def __init__(self, run_dir: Optional[str], total_steps: int, progress: bool,
                 wandb_run=None, first_step: int = 0):
        self.enabled = run_dir is not None
        self.wandb = wandb_run
        self.name = os.path.basename(os.path.normpath(run_dir)) if run_dir else ""
        self.last: dict = {}  # the latest value of every metric recorded, for the summary
        self.best: dict = {}  # the best val_loss so far
        # W&B's step for what is logged once at start (tables, pictures): W&B drops points
        # below its current step, which a resumed run has already passed.
        self.start_step = 0
        self._file = None
        self._bar = None
        self.run_dir = run_dir
        if not self.enabled:
            return
        # A start at step 0 replays everything an earlier start recorded, a resume what came
        # after its checkpoint (a later one failed or was damaged).
        replayed = set_aside_replayed(run_dir, first_step if first_step > 0 else -1)
        if replayed:
            log.info(replayed)
        self._file = open(os.path.join(run_dir, METRICS), "a", buffering=1)
        self._redirect = contextlib.ExitStack()
        if progress:
            from tqdm import tqdm
            from tqdm.contrib.logging import logging_redirect_tqdm

            self._bar = tqdm(total=total_steps, initial=first_step, unit="step",
                             dynamic_ncols=True, leave=False, disable=None)
            # Console lines print above the bar; train.log (Hydra's file handler) still gets
            # every one of them.
            self._redirect.enter_context(logging_redirect_tqdm([logging.getLogger()]))

    def step(self, step: int, loss: float, tokens_per_s: float) -> None:
        """Every step: advance the progress bar."""
        if self._bar is not None:
            self._bar.update(1)
            self._bar.set_postfix(loss=f"{loss:.4f}", tok_s=f"{tokens_per_s:,.0f}", refresh=False)

    def record(self, metrics: dict, console: bool = True, wandb_step: Optional[int] = None) -> None:
        """A logged step: one JSON line (floats exact), a console line, and W&B.

        wandb_step: W&B's x axis, which must only grow; after a rollback the optimizer step goes
        back, so the loop passes the number of batches read instead.
        """
        if not self.enabled:
            return
        self.last.update(metrics)
        if "val_loss" in metrics:
            self.best["val_loss"] = min(self.best.get("val_loss", math.inf), metrics["val_loss"])
        self._file.write(json.dumps(metrics) + "\n")
        if console:
            log.info(console_line(metrics))
        if self.wandb is not None:
            logged = {k: v for k, v in metrics.items() if k != "step"}
            if wandb_step is not None:
                logged["opt_step"] = metrics["step"]
            self.wandb.log(logged, step=metrics["step"] if wandb_step is None else wandb_step)

    def rewind(self, step: int) -> None:
        """Back to `step` within the run (a rollback): the steps after it run again, and their
        earlier measurements are set aside as at a resume."""
        if not self.enabled:
            return
        self._file.close()
        replayed = set_aside_replayed(self.run_dir, step)
        if replayed:
            log.info(replayed)
        self._file = open(os.path.join(self.run_dir, METRICS), "a", buffering=1)

    def alert(self, kind: str, step: int, text: str, level: str, sent: bool,
              wandb_step: Optional[int] = None) -> None:
        """One alert (trainer/observe/watch.py decides, and rate-limits `sent`)."""
        if not self.enabled:
            return
        self._file.write(json.dumps({"step": step, "alert": kind, "level": level, "text": text,
                                     "sent": sent}) + "\n")
        if sent:
            log.warning(f"ALERT {kind} (step {step}): {text}")
        if self.wandb is not None:
            self.wandb.log({f"alert/{kind}": 1}, step=step if wandb_step is None else wandb_step)
            if sent:
                self.wandb.alert(f"blocktrain {kind}: {self.name}", text, level)

    def plan(self, table: str, rows: list[dict]) -> None:
        """The per-block plan: printed once at start and kept in W&B as a table."""
        self.table("plan", "per-block plan", table, rows)

    def table(self, key: str, title: str, text: str, rows: list[dict]) -> None:
        """A table printed once and kept in W&B under `key`."""
        self.info(f"{title}:\n{text}")
        if self.wandb is not None:
            self.wandb.log_table(key, rows, self.start_step)

    def info(self, message: str) -> None:
        if self.enabled:
            log.info(message)

    def summary(self, lines: list[str]) -> None:
        """The end of a run, in a few lines (console and train.log)."""
        if self.enabled:
            if self.wandb is not None and self.wandb.sync_command():
                lines = lines + [f"W&B ran offline; upload with: {self.wandb.sync_command()}"]
            log.info("run summary:\n  " + "\n  ".join(lines))

    def close(self) -> None:
        if self._bar is not None:
            self._redirect.close()
            self._bar.close()
        if self._file is not None:
            self._file.close()
        if self.wandb is not None:
            self.wandb.finish()


def run_summary(seconds: float, first_step: int, progress, total_steps: int, peak_bytes: int,
                device_type: str, last: dict, checkpoint: Optional[str]) -> list[str]:
    """The lines that end a run: how long, how far, how well, what memory, what to do next."""
    minutes, secs = divmod(int(seconds), 60)
    lines = [f"{minutes} min {secs} s; steps {first_step} -> {progress.step} of {total_steps}; "
             f"{progress.tokens_seen:,} tokens seen"
             + (f"; {progress.skipped_steps} skipped steps" if progress.skipped_steps else "")]
    scores = [f"{k} {last[k]:.4f}" for k in ("loss", "val_loss", "val_accuracy") if k in last]
    if scores:
        lines.append("last " + ", ".join(scores))
    lines.append(f"peak memory {peak_bytes / 2**30:.2f} GiB "
                 f"({'max allocated' if device_type == 'cuda' else 'process peak RSS'})")
    if checkpoint:
        lines.append(f"last checkpoint {checkpoint}; export it with: python -m trainer.export "
                     f"{checkpoint}")
    else:
        lines.append("no checkpoint written")
    return lines


# What the console shows of a record; the whole record is in metrics.jsonl (and W&B).
CONSOLE = ("loss", "val_loss", "val_accuracy", "tokens_per_s", "peak_mem_bytes")


def console_line(metrics: dict) -> str:
    """`step 20 | loss 0.9856 | 8,878 tok/s | peak 0.78 GiB`; evaluations show val_loss and
    val_accuracy, and a record with none of these keys (an event) shows in full."""
    shown = [k for k in CONSOLE if k in metrics]
    if not shown:
        return " | ".join(_format(k, v) for k, v in metrics.items())
    parts = [f"step {metrics['step']}"] if "step" in metrics else []
    for key in shown:
        value = metrics[key]
        if key == "tokens_per_s":
            parts.append(f"{value:,.0f} tok/s")
        elif key == "peak_mem_bytes":
            parts.append(f"peak {value / 2**30:.2f} GiB")
        else:
            parts.append(_format(key, value))
    return " | ".join(parts)


def _format(key: str, value) -> str:
    if isinstance(value, float):
        if key.endswith("bytes"):
            return f"{key} {value / 2**30:.2f}GiB"
        return f"{key} {value:.4g}"
    if isinstance(value, int) and key.endswith("bytes"):
        return f"{key.replace('_bytes', '')} {value / 2**30:.2f}GiB"
    return f"{key} {value}"


def startup_fields(build_s: float, first_step_s: float, to_first_step_s: float,
                   compiled_blocks: int) -> dict:
    """What starting cost, logged with the first step: building the model (profiling included,
    which compiles there under train.compile), the first step (compiling its graphs), and all
    from the start of the build to the end of the first step (the first evaluation too)."""
    fields = {"build_s": build_s, "first_step_s": first_step_s,
              "to_first_step_s": to_first_step_s}
    if compiled_blocks:
        from checkpointing.compiled import graphs_compiled

        fields["compiled_graphs"] = graphs_compiled()
    return fields


def startup_line(fields: dict, compiled_blocks: int) -> str:
    line = (f"start-up: {fields['to_first_step_s']:.1f} s to the end of the first step (model "
            f"built in {fields['build_s']:.1f} s, the step itself {fields['first_step_s']:.1f} s)")
    if compiled_blocks:
        line += (f"; torch.compile: {compiled_blocks} blocks, {fields['compiled_graphs']} graphs "
                 "compiled in this process (profiling and evaluation included; blocks of the "
                 "same class and shapes share one)")
    return line


def summary_fields(logger: RunLogger, progress, seconds: float, peak_bytes: int) -> dict:
    """The run's W&B summary: how far, how well, how long, how much memory (MFU on CUDA)."""
    fields = {"final/loss": logger.last.get("loss"), "final/val_loss": logger.last.get("val_loss"),
              "final/best_val_loss": logger.best.get("val_loss"),
              "final/tokens_seen": progress.tokens_seen, "final/step": progress.step,
              "final/skipped_steps": progress.skipped_steps, "final/time_s": seconds,
              "final/peak_memory_bytes": peak_bytes}
    if "mfu" in logger.last:
        fields["final/mfu"] = logger.last["mfu"]
    return {k: v for k, v in fields.items() if v is not None}
