"""What W&B shows beyond the per-step metrics: the memory story, and which run this is.

At start, on rank 0:
- the run's identity: the config (with Hydra's group choices and tags such as
  `checkpointing=full`), grouped by Slurm job or Hydra sweep so requeued and swept runs sit
  together;
- the predicted memory of this run's own plan: the pre-flight report's phases (`memory_plan`
  table), its picture (`memory_plan_png`; both also written to the run directory as
  memory_plan.json / .png; its one-line summary goes to the console and train.log), and
  `plan_blocks`: per block, the saved bytes and recompute FLOPs of every option (none /
  selective / full, from the meta trace: no profiling needed), the option chosen, and the
  profiled seconds where blocks were profiled;
- the prediction as summary fields, with the measured peak beside it once steps are logged, and
  an alert when the measurement exceeds it by more than `logging.alert_memory_margin`.

The prediction needs a meta trace (seconds for a large model), so it is made only when someone
will look at it: with W&B on, or on CUDA (where the memory alert watches max allocated).
"""

from __future__ import annotations

import json
import logging
import os
from typing import Optional

from checkpointing.planner.profile import OPTIONS
from trainer.config import Config
from trainer.distenv import DistEnv
from trainer.observe.metrics import RunLogger
from trainer.state.checkpoint import STOPPED_MARKER
from trainer.observe.watch import Alerts, memory_text

log = logging.getLogger("trainer")


def run_group() -> tuple[Optional[str], dict]:
    """(W&B group, Hydra's group choices): the Slurm job (requeues keep its id) or the Hydra
    sweep this run belongs to."""
    choices, group = {}, None
    try:
        from hydra.core.hydra_config import HydraConfig
        from hydra.types import RunMode

        hydra = HydraConfig.get()
        choices = {k: v for k, v in hydra.runtime.choices.items()
                   if not k.startswith("hydra") and v is not None}
        if hydra.mode == RunMode.MULTIRUN:
            group = f"sweep-{os.path.basename(os.path.normpath(hydra.sweep.dir))}"
    except (ImportError, ValueError):  # not started by Hydra (tests, embedding)
        pass
    job = os.environ.get("SLURM_ARRAY_JOB_ID") or os.environ.get("SLURM_JOB_ID")
    return (f"slurm-{job}" if job else group), choices


def start_logging(cfg: Config, denv: DistEnv, run_dir: str, first_step: int) -> RunLogger:
    if not denv.is_main:
        return RunLogger(None, cfg.train.steps, progress=False)
    wandb_run = None
    if cfg.logging.wandb:
        import dataclasses

        from trainer.observe.wandb_log import WandbLogger

        group, choices = run_group()
        config = {**dataclasses.asdict(cfg), "groups": choices}
        wandb_run = WandbLogger.start(run_dir, config, cfg.logging.wandb_project,
                                      cfg.logging.wandb_entity, os.path.basename(run_dir),
                                      cfg.logging.wandb_init_timeout_s, group=group,
                                      tags=[f"{k}={v}" for k, v in sorted(choices.items())])
    return RunLogger(run_dir, cfg.train.steps, cfg.logging.progress, wandb_run, first_step)


def block_table(outcome, plan, profiles) -> list[dict]:
    """Per block: the choice, and every option's predicted saved bytes and recompute FLOPs."""
    rows = []
    for p, measure in zip(plan, outcome.profile.blocks, strict=True):
        row = {"index": p.index, "name": p.name, "recompute": p.recompute, "offload": p.offload}
        for o in OPTIONS:
            row[f"saved_bytes_{o}"] = measure.saved_bytes[o]
            row[f"recompute_flops_{o}"] = measure.recompute_flops[o]
            row[f"recompute_s_{o}"] = (profiles[p.index].cost_s.get(o)
                                       if profiles is not None else None)
        rows.append(row)
    return rows


def device_capacity(cfg: Config, denv: DistEnv) -> Optional[int]:
    """The memory the picture and its line compare with: train.memory_gib, else a CUDA device's
    total (the whole device, as the report's --gpu-memory-gib), else none (CPU)."""
    if cfg.train.memory_gib is not None:
        return int(cfg.train.memory_gib * 2 ** 30)
    if denv.device.type == "cuda":
        import torch

        return torch.cuda.get_device_properties(denv.device).total_memory
    return None


def start_of_run(logger: RunLogger, cfg: Config, built, layout, denv: DistEnv, run_dir: str,
                 resumed, alerts: Alerts) -> Optional[int]:
    """Rank 0: the resumed-after-a-stop alert, and the memory prediction to W&B; returns the
    predicted peak bytes per rank (None when not predicted)."""
    if not denv.is_main:
        return None
    marker = os.path.join(run_dir, STOPPED_MARKER)
    if resumed is not None and os.path.exists(marker):
        with open(marker) as f:
            stopped = json.load(f)
        alerts.fire("resumed", resumed[0].step, f"started again after the stop at step "
                    f"{stopped.get('step')} ({stopped.get('reason')}); continuing from step "
                    f"{resumed[0].step}", level="INFO", wandb_step=resumed[0].batch_index)
    if logger.wandb is None and denv.device.type != "cuda":
        return None
    try:
        from trainer.observe.metrics import peak_flops
        from trainer.preflight.plot import plot_plan
        from trainer.preflight.tables import summary
        from trainer.preflight.scenario import Evaluator, Scenario
        from trainer.preflight.timeline import picture_line

        flops = peak_flops(denv.device)
        evaluator = Evaluator(flops / 1e12 if flops else 1.0,
                              optimizer_foreach=denv.device.type == "cuda",
                              device_type=denv.device.type)
        outcome = evaluator.evaluate(Scenario(cfg, layout, denv.local_world_size), built.plan)
        predicted = summary(outcome)
        with open(os.path.join(run_dir, "memory_plan.json"), "w") as f:
            json.dump(predicted, f, indent=1)
        picture = os.path.join(run_dir, "memory_plan.png")
        capacity = device_capacity(cfg, denv)
        plot_plan(outcome, picture, capacity)
        logger.info(picture_line(outcome, capacity))
        blocks = block_table(outcome, built.plan, built.profiles)
    except Exception as exc:  # a prediction must never stop a run
        log.warning("memory prediction for the dashboard skipped: %s", exc)
        return None
    peak = predicted["per_rank_bytes"]["predicted_peak"]
    if logger.wandb is not None:
        phases = [{"phase": p["name"], **{k: v for k, v in p.items() if k != "name"}}
                  for p in predicted["phases"]]
        logger.wandb.log_media({"memory_plan": ("table", phases),
                                "memory_plan_png": ("image", picture),
                                "plan_blocks": ("table", blocks)}, logger.start_step)
        logger.wandb.summary({"memory/predicted_peak_bytes" if k == "predicted_peak"
                              else f"memory/predicted_{k}_bytes": v
                              for k, v in predicted["per_rank_bytes"].items()})
    return peak


def measured_peak(metrics: dict) -> tuple[Optional[int], str]:
    """The measurement comparable with the prediction: CUDA max allocated, else the live tensor
    bytes when this step counted them (logging.live_bytes_step); a CPU process's peak RSS
    includes the interpreter and is not."""
    if "peak_reserved_bytes" in metrics:  # CUDA: peak_mem_bytes is max allocated
        return metrics["peak_mem_bytes"], "max allocated"
    if "live_peak_bytes" in metrics:
        return metrics["live_peak_bytes"], "live tensor bytes"
    return None, ""


def watch_memory(logger: RunLogger, alerts: Alerts, predicted: Optional[int], metrics: dict,
                 margin: float, wandb_step: int) -> None:
    measured, what = measured_peak(metrics)
    if predicted is None or measured is None:
        return
    if logger.wandb is not None:
        logger.wandb.summary({"memory/measured_peak_bytes": measured,
                              "memory/measured_as": what,
                              "memory/measured_over_predicted": measured / predicted})
    text = memory_text(measured, predicted, margin, what)
    if text:
        alerts.fire("memory", metrics["step"], text, wandb_step=wandb_step)


def end_of_run(logger: RunLogger, fields: dict, checkpoint: Optional[str], step: int,
               checkpoint_refs: bool, alerts: Alerts) -> None:
    """Rank 0: the run's summary fields, and the last checkpoint as an artifact reference."""
    if logger.wandb is None:
        return
    logger.wandb.summary({**fields, "alerts": dict(alerts.counts)})
    if checkpoint_refs and checkpoint is not None:
        logger.wandb.checkpoint_reference(os.path.abspath(checkpoint), step)
