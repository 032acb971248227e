"""Where this process sits: rank, world, device and backend, read from torchrun's environment.

`python -m trainer` (no torchrun) is a world of one; it still gets a process group (an in-memory
store, no ports) so one process and many run the same sharded code.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from datetime import timedelta
from typing import Mapping, Sequence

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class DistEnv:
    rank: int
    world_size: int
    local_rank: int
    local_world_size: int
    device: torch.device

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def num_nodes(self) -> int:
        return max(1, self.world_size // self.local_world_size)


def pick_device(choice: str, local_rank: int) -> torch.device:
    """`train.device`: auto uses one CUDA device per local rank when there is one, else the CPU."""
    if choice == "cpu" or (choice == "auto" and not torch.cuda.is_available()):
        return torch.device("cpu")
    if not torch.cuda.is_available():
        raise RuntimeError("train.device=cuda but no CUDA device is visible; use train.device=cpu")
    count = torch.cuda.device_count()
    if local_rank >= count:
        raise RuntimeError(f"local rank {local_rank} has no GPU ({count} visible); lower "
                           "torchrun --nproc-per-node to the GPUs per node")
    return torch.device("cuda", local_rank)


def read_env(device_choice: str, env: Mapping[str, str] = os.environ) -> DistEnv:
    world = int(env.get("WORLD_SIZE", "1"))
    local_rank = int(env.get("LOCAL_RANK", "0"))
    return DistEnv(rank=int(env.get("RANK", "0")), world_size=world, local_rank=local_rank,
                   local_world_size=int(env.get("LOCAL_WORLD_SIZE", str(world))),
                   device=pick_device(device_choice, local_rank))


# The torchrun agent that started this worker (None outside torchrun): see _store_is_gone.
_launcher_pid = None


def init_distributed(denv: DistEnv, timeout_s: int) -> None:
    """gloo for CPU tensors always; NCCL as well when the device is a GPU."""
    global _launcher_pid
    if dist.is_initialized():
        return
    if "TORCHELASTIC_RUN_ID" in os.environ:
        _launcher_pid = os.getppid()
    timeout = timedelta(seconds=timeout_s)
    if denv.device.type == "cuda":
        torch.cuda.set_device(denv.device)
        # gloo alongside NCCL serves collectives on CPU tensors (e.g. offloaded state).
        backend, device_id = "cpu:gloo,cuda:nccl", denv.device
    else:
        backend, device_id = "gloo", None
    if denv.world_size == 1 and "MASTER_ADDR" not in os.environ:
        store = dist.HashStore()
        dist.init_process_group(backend, store=store, rank=0, world_size=1, timeout=timeout,
                                device_id=device_id)
    else:
        dist.init_process_group(backend, timeout=timeout, device_id=device_id)


def shutdown(clean: bool = True, destroy: bool = True) -> None:
    """clean: all ranks got here; wait for each other (a failed rank never would).

    destroy=False keeps the process group for the next job of a `-m` sweep in this process: a
    group initialised again under torchrun would read the previous group's keys from the same
    store and connect to addresses that are gone.
    """
    if dist.is_initialized():
        if clean:
            # A rank that tears down its gloo pairs while a peer still talks to it aborts the
            # peer ("terminate called without an active exception"); leave together. The gloo
            # barrier can return on one rank while its last message to a peer is in flight, so
            # the ranks also meet on the store, which does not use those pairs.
            dist.barrier()
            if not _store_is_gone():
                _meet_on_store(timeout_s=60.0)
        if destroy or not clean:
            dist.destroy_process_group()


def mean_over_ranks(value: torch.Tensor) -> float:
    """The mean of a scalar tensor over every rank (the value itself in a world of one)."""
    return reduce_mean(value).item()


def reduce_mean(value: torch.Tensor) -> torch.Tensor:
    """mean_over_ranks, left on the device (read it together with other values: one
    synchronisation)."""
    if dist.is_initialized() and dist.get_world_size() > 1:
        value = value.clone()
        dist.all_reduce(value)  # gloo has no AVG: sum, then divide
        value /= dist.get_world_size()
    return value


def mean_and_sums(value: float, counts: Sequence[int],
                  dtype: torch.dtype = torch.float32) -> tuple[float, list[int]]:
    """`value`'s mean over the ranks and `counts`' sums, in one all-reduce of host memory (gloo,
    which every process group here has): one collective a step carries the loss and the stop
    vote. The mean is taken in `dtype` (the loss's, when float32 or float64) as reduce_mean
    takes it, sum then divide, so a float32 loss averages to the same bits."""
    dtype = dtype if dtype in (torch.float32, torch.float64) else torch.float32
    host = torch.tensor([value, *counts], dtype=dtype)
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(host)  # gloo has no AVG: sum, then divide
        host[:1].div_(dist.get_world_size())
    mean, *sums = host.tolist()
    return mean, [int(c) for c in sums]


def _store_is_gone() -> bool:
    """Whether the agent that hosts this group's store was killed: torchrun's workers share
    its store unless TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 (then rank 0 hosts it). Asking a dead
    store raises, after C++ has printed its own warning, so it is not asked at all."""
    if _launcher_pid is None or os.environ.get("TORCH_DISABLE_SHARE_RDZV_TCP_STORE") == "1":
        return False
    return os.getppid() != _launcher_pid


def _meet_on_store(timeout_s: float) -> None:
    world = dist.get_world_size()
    if world == 1:
        return
    store = dist.distributed_c10d._get_default_store()
    key = "blocktrain/leaving"
    # The counter keeps growing over the meetings of one group (jobs of a sweep): this meeting
    # is over when it reaches the next multiple of the world size.
    target = -(-store.add(key, 1) // world) * world
    deadline = time.monotonic() + timeout_s
    while store.add(key, 0) < target and time.monotonic() < deadline:
        time.sleep(0.01)
    # Rank 0 leaves last: the store may live in its process (torchrun with
    # TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1, as launch.run sets, or a static rendezvous), and a
    # rank still polling a store whose process has exited fails, exiting 1 instead of its own
    # status. The others say they are done with the store; rank 0 waits for all of them.
    done_key, meeting = "blocktrain/left", target // world
    if dist.get_rank() != 0:
        store.add(done_key, 1)
        return
    while store.add(done_key, 0) < meeting * (world - 1) and time.monotonic() < deadline:
        time.sleep(0.01)
