"""The report's whole-step time of an outcome (checkpointing/planner/step_time.py's arithmetic),
with the nominal rates the report states: --tflops, the all-to-all bandwidth of a sequence group
inside a node or across nodes, PCIe for offload and sharding.cpu_offload's copies
(trainer/preflight/scenario.py's figures)."""

from __future__ import annotations

from typing import Optional

from checkpointing.planner.memory import host_copies, host_optimizer_numel
from checkpointing.planner.step_time import HostLink, StepTime, step_time
from trainer.preflight.auto_plan import rest_flops
from trainer.preflight.scenario import (NOMINAL_ALL_TO_ALL_BYTES_PER_S,
                                       NOMINAL_HOST_ADAMW_S_PER_ELEMENT,
                                       NOMINAL_SECONDS_PER_BYTE)
from trainer.task import task_for


def outcome_step_time(outcome, tflops: float, device_type: str = "cuda") -> StepTime:
    sc, profile = outcome.scenario, outcome.profile
    cfg, degree = sc.cfg, sc.layout.degree
    task = task_for(cfg.model, cfg.data, cfg.checkpointing)
    # A rank holds 1/(sequence x context) of each sample's tokens (Ulysses and the ring).
    tokens = task.tokens_per_sample * cfg.train.micro_batch_size // sc.layout.share
    inside = "node" if degree <= sc.gpus_per_node else "network"
    moves = cfg.offload.target == "disk" or (cfg.offload.target == "cpu" and device_type == "cuda")
    return step_time(profile, outcome.plan, sc.layout.grad_accum,
                     rest_flops(cfg, profile, degree), tflops, tokens, sc.gpus_per_node,
                     NOMINAL_ALL_TO_ALL_BYTES_PER_S[inside] if degree > 1 else None,
                     NOMINAL_SECONDS_PER_BYTE.get(cfg.offload.target) if moves else None,
                     cfg.offload.min_bytes if moves else None, host_link(outcome))


def host_link(outcome) -> Optional[HostLink]:
    """sharding.cpu_offload's copies per micro-batch (on a GPU; None where it is off), at the
    nominal host link rate, and its optimizer step on the host, at the nominal AdamW rate."""
    setup = outcome.setup
    if setup is None or not setup.cpu_offload:
        return None
    blocks, root = host_copies(outcome.groups, setup)
    return HostLink(blocks, root, NOMINAL_SECONDS_PER_BYTE["cpu"],
                    host_optimizer_numel(outcome.groups, setup), NOMINAL_HOST_ADAMW_S_PER_ELEMENT)
