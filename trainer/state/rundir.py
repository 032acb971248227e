"""The run directory's name: the same on every rank, every node and every torchrun restart.

Hydra resolves `hydra.run.dir` separately in each process, so the name must come from something
all processes of one run share and a restarted run still has:
  1. an explicit `train.run_name`;
  2. the Slurm job id (stable across requeues of the same job);
  3. torchrun's rendezvous id (`--rdzv-id`, or the random id `--standalone` makes);
  4. for plain `torchrun` without an id: the start time of the torchrun agent (the workers'
     parent), which all local workers and their restarts share;
  5. a single process: its own start time.
"""

from __future__ import annotations

import os
import re
import time
from typing import Mapping, Optional

_UNSET_RDZV = ("", "none")


def _safe(name: str) -> str:
    return re.sub(r"[^A-Za-z0-9._-]+", "-", name).strip("-") or "run"


def stat_fields(pid: int) -> list[str]:
    """/proc/<pid>/stat's fields after the process's name (Linux; OSError where there is none):
    [0] is stat(5)'s field 3 (state), [1] the ppid, [19] the start time. The name, in
    parentheses, may hold spaces and parentheses itself: the fields follow its last ")"."""
    with open(f"/proc/{pid}/stat") as f:
        return f.read().rsplit(")", 1)[1].split()


def process_start_time(pid: int) -> Optional[float]:
    """Wall-clock start time of a process from /proc (Linux); None where unavailable."""
    try:
        start_ticks = int(stat_fields(pid)[19])  # in clock ticks after boot
        with open("/proc/stat") as f:
            boot = next(int(line.split()[1]) for line in f if line.startswith("btime"))
        return boot + start_ticks / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, StopIteration, IndexError):
        return None


def run_id(run_name: Optional[str], env: Mapping[str, str] = os.environ) -> str:
    if run_name:
        return _safe(str(run_name))
    if env.get("SLURM_JOB_ID"):
        array = env.get("SLURM_ARRAY_TASK_ID")
        return _safe(f"slurm-{env['SLURM_JOB_ID']}" + (f"-{array}" if array else ""))
    rdzv = env.get("TORCHELASTIC_RUN_ID", "")
    if rdzv not in _UNSET_RDZV:
        return _safe(f"torchrun-{rdzv}")
    # torchrun without an id: its agent (our parent) is the one process every local worker and
    # every restart share. TORCHELASTIC_RUN_ID is set by torchrun only, so a plain process that
    # happens to have a parent still names the run after itself.
    pid = os.getppid() if "TORCHELASTIC_RUN_ID" in env else os.getpid()
    started = process_start_time(pid) or time.time()
    # The pid keeps two runs started in the same second apart.
    return time.strftime("run-%Y%m%d-%H%M%S", time.localtime(started)) + f"-{pid}"


def register_resolver() -> None:
    from omegaconf import OmegaConf

    if not OmegaConf.has_resolver("blocktrain_run_id"):
        OmegaConf.register_new_resolver("blocktrain_run_id", run_id, use_cache=True)
