"""Shared test helpers: configs composed exactly as the trainer composes them."""

from __future__ import annotations

from typing import Optional

from trainer.cli import compose
from trainer.config import Config
from trainer.models.families.llama import llama_args
from trainer.models.llama import LlamaArgs


def config(*overrides: str) -> Config:
    return compose(list(overrides))


def layout_of(cfg: Config, world_size: Optional[int] = None):
    """The layout validation makes of `cfg` on this process group's world (or `world_size`)."""
    import torch.distributed as dist

    from trainer.validate import validate

    if world_size is None:
        world_size = dist.get_world_size() if dist.is_initialized() else 1
    return validate(cfg, world_size=world_size)


def sampling(rank: int, world_size: int, micro_batch_size: int, grad_accum: int, seed: int = 0,
             eval_batches: int = 1, sequence: int = 1):
    """A rank's Sampling on an fsdp layout of these sizes."""
    from sharding.layout import make_layout
    from trainer.data.batches import Sampling

    layout = make_layout("fsdp", world_size, None, sequence, micro_batch_size, grad_accum, None)
    return Sampling(rank, layout, seed, eval_batches)


def preset(name: str) -> LlamaArgs:
    """The Llama shapes of conf/model/<name>.yaml (the one place presets are defined)."""
    return llama_args(config(f"model={name}").model)


# --- running the trainer as a user does -----------------------------------------------------

import contextlib
import json
import os
import socket
import struct
import subprocess
import sys
import time
from pathlib import Path
from typing import Iterator, Sequence

REPO = Path(__file__).resolve().parent.parent
# Fast, deterministic CLI runs: a short tiny-model job without W&B unless a test asks for it.
QUICK = ["data.seq_len=64", "train.micro_batch_size=4", "train.eval_every=5",
         "train.eval_batches=2", "logging.every=1", "logging.wandb=false",
         "logging.progress=false", "optim.warmup_steps=2", "data.max_corpus_bytes=2000000"]


def subprocess_env(extra: Optional[dict] = None) -> dict:
    env = dict(os.environ)
    env.update({"WANDB_MODE": "offline", "WANDB_SILENT": "true", "OMP_NUM_THREADS": "1",
                "PYTHONPATH": str(REPO) + os.pathsep + env.get("PYTHONPATH", "")})
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR",
                "MASTER_PORT", "TORCHELASTIC_RUN_ID", "SLURM_JOB_ID"):
        env.pop(key, None)
    env.update(extra or {})
    return env


def wait_until_handling(pid: int, limit_s: float = 60.0) -> None:
    """Until the process handles SIGTERM: the first lines of our entry points (trainer/__main__,
    launch/run) install their stop handlers. Before that the interpreter is still starting (its
    `site` imports, stretched past a second on a loaded machine), where a Ctrl-C is CPython's
    own fatal error and status 1, which no code of ours can run to turn into one line."""
    import time

    from launch.worker_signals import handles_sigterm

    deadline = time.monotonic() + limit_s
    while handles_sigterm(pid) is False and time.monotonic() < deadline:
        time.sleep(0.005)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def trainer_command(overrides: Sequence[str], nproc: int = 1, torchrun_args: Sequence[str] = (),
                    launcher: str = "torch.distributed.run") -> list[str]:
    """`python -m trainer ...`, or under a launcher (torchrun, or ours: launch.run) with nproc
    processes."""
    if nproc == 1 and not torchrun_args:
        return [sys.executable, "-m", "trainer", *overrides]
    return [sys.executable, "-m", launcher, f"--nproc-per-node={nproc}",
            *(torchrun_args or ["--rdzv-backend=c10d", f"--rdzv-endpoint=127.0.0.1:{free_port()}"]),
            "-m", "trainer", *overrides]


def run_trainer(overrides: Sequence[str], cwd: Path, nproc: int = 1, timeout: float = 300,
                env: Optional[dict] = None, torchrun_args: Sequence[str] = (),
                launcher: str = "torch.distributed.run") -> subprocess.CompletedProcess:
    """`python -m trainer ...`, or under torchrun (or `launcher`) with nproc processes."""
    return subprocess.run(trainer_command(overrides, nproc, torchrun_args, launcher), cwd=cwd,
                          env=subprocess_env(env), capture_output=True, text=True,
                          timeout=timeout)


def check_ok(result: subprocess.CompletedProcess) -> None:
    assert result.returncode == 0, f"exit {result.returncode}\n{result.stdout[-3000:]}\n{result.stderr[-5000:]}"


def read_metrics(run_dir: Path) -> list[dict]:
    with open(run_dir / "metrics.jsonl") as f:
        return [json.loads(line) for line in f]


def losses(run_dir: Path) -> list[float]:
    return [m["loss"] for m in read_metrics(run_dir) if "loss" in m]


def read_wandb_records(path: Path) -> list:
    """Records of an offline W&B run file: a 7-byte W&B header, then LevelDB log blocks of
    32 KiB holding length-prefixed protobuf `Record`s (FULL=1, FIRST=2, MIDDLE=3, LAST=4)."""
    from wandb.proto import wandb_internal_pb2 as pb

    data = path.read_bytes()
    assert data[:4] == b":W&B", f"{path} is not a W&B run file"
    records, pending, pos, block = [], b"", 7, 32768
    while pos + 7 <= len(data):
        left_in_block = block - pos % block
        if left_in_block < 7:
            pos += left_in_block
            continue
        length, kind = struct.unpack("<HB", data[pos + 4:pos + 7])
        chunk = data[pos + 7:pos + 7 + length]
        pos += 7 + length
        if kind == 0 and length == 0:
            continue
        pending = chunk if kind in (1, 2) else pending + chunk
        if kind in (1, 4):
            record = pb.Record()
            record.ParseFromString(pending)
            records.append(record)
            pending = b""
    return records


# The launcher tests' run (Slurm, two torchrun agents): long enough that a signal sent after the
# third step lands mid-run; dropout on, so the RNG streams of every rank must line up.
LAUNCH_RUN = [*QUICK, "train.steps=24", "save.every=100", "model.dropout=0.1"]


def step_losses(run_dir: Path) -> dict[int, float]:
    """The loss of every applied step; after a restart or rollback the last record wins."""
    out = {}
    for m in read_metrics(run_dir):
        if "loss" in m:
            out[m["step"]] = m["loss"]
    return out


# --- starting a run and stopping it as a terminal or a scheduler would ----------------------

# Long enough that a signal sent after the first steps lands mid-run.
LONG_RUN = QUICK + ["data=synthetic", "train.steps=400", "save.every=0", "train.eval_every=400"]


def start_trainer(overrides: Sequence[str], cwd: Path, nproc: int = 1,
                  torchrun_args: Sequence[str] = (), launcher: str = "torch.distributed.run",
                  **kwargs) -> subprocess.Popen:
    """The run in the background (Popen's own arguments in kwargs)."""
    return subprocess.Popen(trainer_command(overrides, nproc, torchrun_args, launcher), cwd=cwd,
                            env=subprocess_env(), text=True, **kwargs)


def wait_for_step(run_dir: Path, step: int, process: subprocess.Popen, timeout: float = 120):
    """Until metrics.jsonl has the loss of `step` (or a later one)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        assert process.poll() is None, "the run ended early"
        if (run_dir / "metrics.jsonl").exists() and any(
                m.get("step", 0) >= step and "loss" in m for m in read_metrics(run_dir)):
            return
        time.sleep(0.2)
    raise AssertionError(f"step {step} not reached")


def committed_steps(run_dir: Path) -> list[int]:
    return sorted(int(p.parent.name[len("step_"):])
                  for p in (run_dir / "checkpoints").glob("step_*/COMMITTED.json"))


@contextlib.contextmanager
def small_tmpfs(folder: Path, size: str) -> Iterator[Path]:
    """A tmpfs of `size` (e.g. "1m") mounted at `folder` (made here) for the test's duration:
    a real full disk. Skips the test where mounting needs root this process does not have."""
    import pytest

    folder.mkdir()
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(folder)],
                          capture_output=True, text=True)
    if done.returncode != 0:
        pytest.skip(f"cannot mount a small tmpfs here (needs root): {done.stderr.strip()}")
    try:
        yield folder
    finally:
        subprocess.run(["umount", "-l", str(folder)], check=False)
