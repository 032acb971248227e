"""Carrying out the sharding part of the plan: device mesh, FSDP2 per block, or plain DDP.

Order matters and is fixed by the caller: per-block wrappers (offload hooks, checkpointing,
compile) first, then `fully_shard` on each block, then on the root. Sharding the block *outside*
its checkpoint wrapper means recompute runs inside FSDP's unshard window, so backward all-gathers a
block's parameters once, not twice.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Optional, Sequence

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import (CPUOffloadPolicy, FSDPModule, MixedPrecisionPolicy,
                                    OffloadPolicy, fully_shard)

from checkpointing.plan import BlockPlan
from sharding.layout import Layout

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def build_mesh(layout: Layout, device_type: str) -> Optional[DeviceMesh]:
    """1-D ("shard") for fsdp, 2-D ("replicate", "shard") for hsdp, none for sharding=none."""
    if layout.mode == "fsdp":
        return init_device_mesh(device_type, (layout.world_size,), mesh_dim_names=("shard",))
    if layout.mode == "hsdp":
        return init_device_mesh(device_type, (layout.replicate, layout.shard),
                                mesh_dim_names=("replicate", "shard"))
    return None


def mixed_precision(param_dtype: Optional[str], reduce_dtype: Optional[str]) -> MixedPrecisionPolicy:
    return MixedPrecisionPolicy(param_dtype=DTYPES[param_dtype] if param_dtype else None,
                                reduce_dtype=DTYPES[reduce_dtype] if reduce_dtype else None)


def apply_fsdp(model: nn.Module, blocks: Sequence[nn.Module], plan: Sequence[BlockPlan],
               mesh: DeviceMesh, mp_policy: MixedPrecisionPolicy,
               reshard_after_forward: bool, cpu_offload: bool = False) -> None:
    """fully_shard each block the plan shards, then the root (embeddings, head, the rest).

    cpu_offload: sharded parameters, their gradients and so the optimizer state live in (pinned)
    CPU memory; FSDP2 copies a block's shard to the device for its all-gather and its gradient
    back after the reduce-scatter, and the optimizer steps on the CPU.
    """
    offload = CPUOffloadPolicy() if cpu_offload else OffloadPolicy()
    sharded = [i for i, p in enumerate(plan) if p.shard]
    # FSDP would cast every floating-point input of a block to param_dtype, the float32 rotary
    # tables too, which the model keeps in float32 for position precision at long sequences.
    # A block casts only its hidden state (its first argument); the root still casts the
    # model's inputs (images), and the blocks' outputs stay in param_dtype as they are.
    block_policy = replace(mp_policy, cast_forward_inputs=False)
    for i, (block, block_plan) in enumerate(zip(blocks, plan, strict=True)):
        if block_plan.shard:
            # The last block's backward comes first: freeing its parameters after forward would
            # only all-gather them again at once.
            fully_shard(block, mesh=mesh, mp_policy=block_policy,
                        reshard_after_forward=reshard_after_forward and i != sharded[-1],
                        offload_policy=offload)
            if mp_policy.param_dtype is not None and mp_policy.cast_forward_inputs:
                block.register_forward_pre_hook(_HiddenCast(mp_policy.param_dtype))
    # The root (embeddings, final norm, head) follows the flag: torch 2.13 does reshard it after
    # forward when told to, and keeping it costs its unsharded size at the loss, often the step's
    # peak (measured in tests/test_reshard.py: +8 MiB on an 81 MiB peak), for one all-gather.
    fully_shard(model, mesh=mesh, mp_policy=mp_policy, reshard_after_forward=reshard_after_forward,
                offload_policy=offload)


class _HiddenCast:
    """Forward pre-hook: the block's first argument (its hidden state) in `dtype`."""

    def __init__(self, dtype: torch.dtype) -> None:
        self.dtype = dtype

    def __call__(self, module: nn.Module, args: tuple) -> Optional[tuple]:
        if args and torch.is_tensor(args[0]) and args[0].is_floating_point() \
                and args[0].dtype != self.dtype:
            return (args[0].to(self.dtype), *args[1:])
        return None


def apply_ddp(model: nn.Module, device: torch.device) -> nn.Module:
    """sharding=none with several ranks: replicate the model, average gradients."""
    from torch.nn.parallel import DistributedDataParallel

    device_ids = [device.index] if device.type == "cuda" else None
    return DistributedDataParallel(model, device_ids=device_ids)


def set_grad_sync(model: nn.Module, enabled: bool) -> None:
    """Which gradient communication a micro-batch does that is not the last of its step.

    FSDP: reduce-scatter every micro-batch anyway. Skipping it would keep whole unsharded
    gradients alive between micro-batches, the memory FSDP exists to save.
    HSDP: reduce-scatter within the shard group every time, but all-reduce across replicas only
    on the last micro-batch (the sharded gradients it reduces are small).
    DDP: all-reduce only on the last micro-batch (its gradients are whole anyway).
    """
    if isinstance(model, FSDPModule):
        model.set_requires_all_reduce(enabled)  # no all-reduce exists without a replicate dim
    elif hasattr(model, "require_backward_grad_sync"):  # DDP, without a context manager
        model.require_backward_grad_sync = enabled


def reshard_all(model: nn.Module) -> None:
    """Free unsharded parameters a forward without backward left behind (eval with
    reshard_after_forward=false), so evaluation does not raise training's memory."""
    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.reshard()
