"""`python -m launch.slurm --nodes 2 --gpus-per-node 8 [options] -- <trainer overrides>`

Writes the Slurm job script (launch/train.sbatch filled in) and submits it with sbatch. Before
anything is submitted, every job is checked: the trainer config composes and validates for the
job's world size, and the request fits the cluster (`scontrol`). A mistake is one line naming the
flag or key, exit status 2, and nothing is submitted.

  --dry-run    print the script(s) instead of submitting (no cluster needed; checked if reachable)
  --validate   check config and request, print what would run, submit nothing

Overrides with sweeps (`checkpointing=none,full`, `optim.lr=range(...)`) become one job per
combination, in Hydra's order; all are checked before the first is submitted.
"""

from __future__ import annotations

import argparse
import os
import shlex
import subprocess
import sys
from dataclasses import dataclass
from typing import Optional, Sequence

from launch.cluster import Cluster, check_request, parse_time, query, slurm_available
from launch.cluster_env import parse_assignments
from launch.sbatch import JobRequest, render
from trainer import cli
from trainer.config import Config, ConfigError
from trainer.state.rundir import run_id

USAGE_ERROR = 2


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m launch.slurm", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--nodes", type=int, default=1)
    p.add_argument("--gpus-per-node", type=int, default=0)
    p.add_argument("--nproc-per-node", type=int, default=None,
                   help="trainer processes per node (default: --gpus-per-node, or 1 without GPUs)")
    p.add_argument("--cpus-per-task", type=int, default=None, help="CPUs for each node's task")
    p.add_argument("--partition")
    p.add_argument("--time", help="Slurm time limit, e.g. 04:00:00 or 2-00:00:00")
    p.add_argument("--account")
    p.add_argument("--qos")
    p.add_argument("--job-name", default="blocktrain")
    p.add_argument("--signal-lead", type=int, default=300, metavar="SECONDS",
                   help="send save.signal this long before the time limit (default 300)")
    p.add_argument("--max-restarts", type=int, default=0,
                   help="torchrun restarts of failed workers inside the allocation")
    p.add_argument("--join-timeout", type=int, default=900, metavar="SECONDS",
                   help="how long the rendezvous waits for every node to join")
    p.add_argument("--env", action="append", default=[], metavar="NAME=VALUE",
                   help="set an environment variable in the job (replaces a default)")
    p.add_argument("--sbatch-arg", action="append", default=[], metavar="OPTION",
                   help="an extra #SBATCH option, e.g. --sbatch-arg=--constraint=h100")
    p.add_argument("--python", default=sys.executable, help="interpreter on the compute nodes")
    mode = p.add_mutually_exclusive_group()
    mode.add_argument("--dry-run", action="store_true", help="print the job script(s)")
    mode.add_argument("--validate", action="store_true", help="check, print, submit nothing")
    p.add_argument("overrides", nargs="*", help="trainer overrides (after --)")
    return p


@dataclass
class Job:
    overrides: list[str]
    request: JobRequest
    run_dir: str  # may end in ${SLURM_JOB_ID}
    out_dir: str
    script: str


def request_from(args: argparse.Namespace, job_name: str) -> JobRequest:
    if args.nodes < 1:
        raise ConfigError("--nodes", f"{args.nodes}: must be at least 1")
    if args.gpus_per_node < 0:
        raise ConfigError("--gpus-per-node", f"{args.gpus_per_node}: must be 0 or more")
    nproc = args.nproc_per_node or max(1, args.gpus_per_node)
    if nproc < 1:
        raise ConfigError("--nproc-per-node", f"{nproc}: must be at least 1")
    if args.gpus_per_node and nproc > args.gpus_per_node:
        raise ConfigError("--nproc-per-node", f"{nproc} processes per node but "
                          f"--gpus-per-node {args.gpus_per_node}; each process drives one GPU")
    try:
        env = parse_assignments(args.env)
    except ValueError as exc:
        raise ConfigError("--env", str(exc).partition(": ")[2]) from exc
    return JobRequest(nodes=args.nodes, gpus_per_node=args.gpus_per_node, nproc_per_node=nproc,
                      cpus_per_task=args.cpus_per_task, partition=args.partition,
                      time=args.time, account=args.account, qos=args.qos, job_name=job_name,
                      signal_lead_s=args.signal_lead,
                      max_restarts=args.max_restarts, join_timeout_s=args.join_timeout,
                      python=args.python, workdir=os.getcwd(), env=env,
                      sbatch_args=list(args.sbatch_arg))


def check_config(overrides: Sequence[str], nodes: int, nproc: int, gpus: int) -> Config:
    """The trainer's own checks for this world size, then what a Slurm job needs of it."""
    env = {"RANK": "0", "WORLD_SIZE": str(nodes * nproc), "LOCAL_WORLD_SIZE": str(nproc)}
    cfg, _ = cli.check(list(overrides), env, local_gpus=False)
    if cfg.train.device == "cuda" and not gpus:
        raise ConfigError("--gpus-per-node", "0, but train.device=cuda; request GPUs or set "
                                             "train.device=cpu")
    if not cfg.save.resume:
        raise ConfigError("save.resume", "false: a preempted and requeued job would start "
                                         "over; keep save.resume=true for Slurm jobs")
    return cfg


def run_dir_of(cfg: Config, overrides: Sequence[str], workdir: str) -> str:
    """What the trainer would choose (trainer/state/rundir.py), absolute; the job passes it on."""
    for override in reversed(overrides):
        if override.startswith("hydra.run.dir="):
            return os.path.join(workdir, override.partition("=")[2])
    out_dir = os.path.join(workdir, cfg.train.out_dir)
    name = run_id(cfg.train.run_name, env={}) if cfg.train.run_name else "slurm-${SLURM_JOB_ID}"
    return os.path.join(out_dir, name)


def read_cluster(args: argparse.Namespace) -> tuple[Optional[Cluster], str]:
    """The cluster to check the request against, or None and why not (a dry run may be made
    away from the cluster; submitting and --validate need it)."""
    if not slurm_available() and args.dry_run:
        return None, "cluster not checked: no scontrol/sbatch on PATH"
    try:
        return query(), ""
    except ConfigError as exc:
        if args.dry_run:
            return None, f"cluster not checked: {exc}"
        raise


def plan(args: argparse.Namespace, cluster: Optional[Cluster],
         summary: str = "") -> tuple[list[Job], str]:
    """Every job of the command line, checked; and a summary of the cluster check."""
    if any(o in ("-m", "--multirun") for o in args.overrides):
        raise ConfigError("-m", "not needed: a sweep in the overrides becomes one job each")
    sweep = cli.expand_sweep(args.overrides)
    jobs = []
    for i, overrides in enumerate(sweep):
        name = args.job_name if len(sweep) == 1 else f"{args.job_name}-{i}"
        req = request_from(args, name)
        cfg = check_config(overrides, req.nodes, req.nproc_per_node, req.gpus_per_node)
        req.signal = (cfg.save.signal or "SIGTERM").removeprefix("SIG")
        time_s = None
        if req.time:
            try:
                time_s = parse_time(req.time)
            except ValueError as exc:
                raise ConfigError("--time", str(exc)) from exc
            if time_s is not None and req.signal_lead_s >= time_s:
                raise ConfigError("--signal-lead", f"{req.signal_lead_s} s is not shorter than "
                                  f"--time {req.time}; the trainer would be stopped at once")
        if cluster is not None:
            summary = check_request(cluster, req.partition, req.nodes, req.gpus_per_node,
                                    req.cpus_per_task, time_s)
        out_dir = os.path.join(req.workdir, cfg.train.out_dir)
        req.output = os.path.join(out_dir, "slurm-%x-%j.out")
        run_dir = run_dir_of(cfg, overrides, req.workdir)
        origin = ("generated by: python -m launch.slurm "
                  + " ".join(shlex.quote(a) for a in args.argv))
        script = render(req, run_dir, overrides, origin)
        jobs.append(Job(overrides, req, run_dir, out_dir, script))
    return jobs, summary


def submit(job: Job) -> str:
    os.makedirs(job.out_dir, exist_ok=True)  # sbatch does not create its output's folder
    result = subprocess.run(["sbatch", "--parsable"], input=job.script, capture_output=True,
                            text=True, timeout=120)
    if result.returncode != 0:
        reason = (result.stderr or result.stdout).strip().splitlines()
        raise RuntimeError(f"sbatch refused {job.request.job_name}: "
                           f"{reason[-1] if reason else 'exit ' + str(result.returncode)}")
    return result.stdout.strip().split(";")[0]


def main(argv: Optional[Sequence[str]] = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = build_parser().parse_args(argv)
    args.argv = argv
    try:
        jobs, summary = plan(args, *read_cluster(args))
    except ConfigError as exc:
        cli.print_error(exc, env={})
        return USAGE_ERROR
    if args.dry_run:
        for i, job in enumerate(jobs):
            if len(jobs) > 1:
                print(f"# ===== job {i + 1} of {len(jobs)} =====")
            print(job.script, end="")
        print(f"# {summary}", file=sys.stderr)
        return 0
    for i, job in enumerate(jobs):
        req = job.request
        print(f"ok: {req.job_name}: {req.nodes} nodes x {req.nproc_per_node} processes (world "
              f"{req.nodes * req.nproc_per_node}); {summary}; overrides: "
              f"{' '.join(job.overrides) or '(none)'}")
    if args.validate:
        return 0
    submitted = []
    for job in jobs:
        try:
            job_id = submit(job)
        except (RuntimeError, OSError, subprocess.SubprocessError) as exc:
            done = f" (already submitted: {', '.join(submitted)})" if submitted else ""
            print(f"error: {exc}{done}", file=sys.stderr, flush=True)
            return 1
        submitted.append(job_id)
        print(f"submitted job {job_id}: run dir {job.run_dir.replace('${SLURM_JOB_ID}', job_id)}"
              f"; output {job.request.output.replace('%x', job.request.job_name).replace('%j', job_id)}",
              flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
