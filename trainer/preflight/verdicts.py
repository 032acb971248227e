"""The report's verdicts beyond the device peak: the whole step's time and host memory, as the
lines it prints and the keys memory_plan.json gets, and the overall verdict a job script reads
from the exit status (trainer/report.py: 0 fits, 3 does not)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from checkpointing.planner.step_time import step_lines
from trainer.preflight.host_memory import host_lines, host_verdict
from trainer.preflight.step_report import outcome_step_time
from trainer.preflight.tables import host_check


@dataclass(frozen=True)
class Verdicts:
    step_lines: list[str]  # printed before the device verdict
    host_lines: list[str]  # printed after it
    keys: dict  # for memory_plan.json
    fits: Optional[bool]  # device and host; None: nothing judged


def verdicts(outcome, capacity: Optional[int], host: Optional[int], tflops: float,
             device_type: str) -> Verdicts:
    step = outcome_step_time(outcome, tflops, device_type)
    host_side = host_verdict(outcome, host, outcome.scenario.cfg.train.host_reserve_gib)
    peak = outcome.estimate.peak.total
    device_fits = None if capacity is None else peak <= capacity
    fits = (None if device_fits is None and host_side.fits is None
            else device_fits is not False and host_side.fits is not False)
    keys = {"fits": fits, "device_fits": device_fits, "host_fits": host_side.fits,
            "host": {"pinned_per_rank_bytes": host_side.per_rank,
                     "pinned_per_node_bytes": host_side.per_node,
                     "pool_activation_bytes": host_side.activations,
                     "reserve_bytes": host_side.reserve, "usable_bytes": host_side.usable},
            "step_seconds": step.step_s, "tokens_per_s_per_node": step.tokens_per_s_per_node,
            "step_time": step.as_dict()}
    return Verdicts(step_lines(step), host_lines(host_side) + host_check(outcome), keys, fits)
