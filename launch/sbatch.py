"""The Slurm job script: launch/train.sbatch with its #SBATCH lines and settings block filled in.

The checked-in template is the script; the generator replaces only its header and its settings
block, so what users copy and edit and what `python -m launch.slurm` submits cannot drift apart.
"""

from __future__ import annotations

import os
import shlex
from dataclasses import dataclass, field
from typing import Optional

from launch.cluster_env import export_lines, merged

TEMPLATE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "train.sbatch")
SETTINGS_START = "# ---- settings ----"
SETTINGS_END = "# ---- end of settings ----"


@dataclass
class JobRequest:
    """One job: the cluster resources and how torchrun runs inside them."""
    nodes: int = 1
    gpus_per_node: int = 0
    nproc_per_node: int = 1
    cpus_per_task: Optional[int] = None
    partition: Optional[str] = None
    time: Optional[str] = None  # Slurm time format; None: the partition's default
    account: Optional[str] = None
    qos: Optional[str] = None
    job_name: str = "blocktrain"
    signal: str = "USR1"  # the trainer's save.signal, without SIG
    signal_lead_s: int = 300  # sent this long before the time limit
    max_restarts: int = 0
    join_timeout_s: int = 900
    python: str = "python"
    workdir: str = "."
    output: str = "slurm-%x-%j.out"
    env: dict[str, str] = field(default_factory=dict)  # replaces/extends the env defaults
    sbatch_args: list[str] = field(default_factory=list)  # extra raw #SBATCH options


def template_parts(path: str = TEMPLATE) -> tuple[str, str]:
    """(the template's leading comment, its body after the settings block)."""
    with open(path) as f:
        text = f.read()
    if SETTINGS_START not in text or SETTINGS_END not in text:
        raise ValueError(f"{path}: the settings markers are missing")
    head = text[:text.index(SETTINGS_START)]
    comment = "".join(line + "\n" for line in head.splitlines()[1:]
                      if line.startswith("#") and not line.startswith("#SBATCH"))
    body = text[text.index(SETTINGS_END) + len(SETTINGS_END):]
    return comment, body


def sbatch_lines(req: JobRequest) -> list[str]:
    opts = [f"--job-name={req.job_name}", f"--nodes={req.nodes}", "--ntasks-per-node=1"]
    if req.gpus_per_node:
        opts.append(f"--gpus-per-node={req.gpus_per_node}")
    if req.cpus_per_task:
        opts.append(f"--cpus-per-task={req.cpus_per_task}")
    for flag, value in (("--partition", req.partition), ("--time", req.time),
                        ("--account", req.account), ("--qos", req.qos)):
        if value:
            opts.append(f"{flag}={value}")
    opts += ["--requeue", "--open-mode=append", f"--chdir={req.workdir}",
             f"--output={req.output}", f"--signal={req.signal}@{req.signal_lead_s}",
             *req.sbatch_args]
    return [f"#SBATCH {opt}" for opt in opts]


def settings_lines(req: JobRequest, run_dir: str, trainer_args: list[str]) -> list[str]:
    """run_dir may end in `${SLURM_JOB_ID}`, left for the job's shell to expand."""
    job_id = "${SLURM_JOB_ID}"
    fixed, sep, rest = run_dir.partition(job_id)
    run_dir_shell = shlex.quote(fixed) + (job_id + (shlex.quote(rest) if rest else "") if sep
                                          else "")
    env = merged(req.env)
    forced_threads = {}
    if req.cpus_per_task and "OMP_NUM_THREADS" not in env:
        # torchrun would set 1 thread per worker; give each its share of the task's CPUs.
        forced_threads["OMP_NUM_THREADS"] = str(max(1, req.cpus_per_task // req.nproc_per_node))
    return [
        SETTINGS_START,
        f"PYTHON={shlex.quote(req.python)}",
        f"NPROC_PER_NODE={req.nproc_per_node}",
        f"MAX_RESTARTS={req.max_restarts}",
        f"JOIN_TIMEOUT_S={req.join_timeout_s}",
        f"PREEMPT_SIGNAL={req.signal}",
        "RDZV_PORT=$((20000 + SLURM_JOB_ID % 10000))",
        f"RUN_DIR={run_dir_shell}",
        "TRAINER_ARGS=(" + " ".join(shlex.quote(a) for a in trainer_args) + ")",
        *export_lines({**env, **forced_threads}, forced=req.env),
        SETTINGS_END,
    ]


def render(req: JobRequest, run_dir: str, trainer_args: list[str], origin: str) -> str:
    """The whole job script. origin: a comment line saying what produced it."""
    comment, body = template_parts()
    lines = ["#!/bin/bash", f"# {origin}", *comment.splitlines(), *sbatch_lines(req), "",
             *settings_lines(req, run_dir, trainer_args)]
    return "\n".join(lines) + body
