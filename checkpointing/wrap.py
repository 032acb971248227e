"""Carrying out the recompute part of the plan: activation checkpointing per block.

The block's own `forward` is replaced by a checkpointed call of the original, on that instance
only. The module tree and parameter names stay as the user wrote them, and every hook that
`fully_shard` (applied later) puts around the block's `__call__` stays *outside* the checkpoint:
recompute in backward runs inside FSDP's unshard window and never all-gathers a second time.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
from typing import Callable, Optional, Sequence

import torch
from torch import nn
from torch.utils.checkpoint import (CheckpointPolicy, checkpoint,
                                    create_selective_checkpoint_contexts)

from torch.utils._python_dispatch import TorchDispatchMode

from checkpointing.plan import DEFAULT_SAVE_OPS, BlockPlan  # noqa: F401 (re-exported)
from checkpointing.meter import SavedBytesMeter


def resolve_ops(names: Sequence[str]) -> list:
    """aten op names -> op overloads; a name not in aten is the user's mistake."""
    ops = []
    for name in names:
        packet = getattr(torch.ops.aten, name, None)
        if packet is None or not hasattr(packet, "overloads"):
            raise ValueError(f"checkpointing.save_ops: {name!r} is not an aten op "
                             "(e.g. mm, addmm, bmm, _scaled_dot_product_flash_attention)")
        ops.extend(getattr(packet, overload) for overload in packet.overloads())
    return ops


@functools.lru_cache(maxsize=None)
def _dropout_index(op) -> Optional[int]:
    """Position of the op's `dropout_p` argument (the fused attention kernels have one)."""
    names = [a.name for a in op._schema.arguments]
    return names.index("dropout_p") if "dropout_p" in names else None


def draws_random(op, args: tuple, kwargs: dict) -> bool:
    """Whether this call of `op` draws from the random number generator: every op tagged
    nondeterministic_seeded does, except a fused attention kernel called with dropout_p=0."""
    if torch.Tag.nondeterministic_seeded not in getattr(op, "tags", ()):
        return False
    index = _dropout_index(op)
    if index is None:
        return True
    value = kwargs.get("dropout_p", args[index] if index < len(args) else 0.0)
    return value > 0


def keeps(op, save_ops: frozenset, args: tuple, kwargs: dict) -> bool:
    """Whether selective checkpointing keeps this call's output.

    Not when the call draws random numbers (attention with dropout on): a kept op is skipped
    during recompute, so the generator is not advanced as it was in forward and every later
    dropout mask of the block comes out shifted, giving wrong gradients without an error. On
    CUDA the fused attention kernels draw their mask inside the op; recomputing it instead
    costs one attention forward per block."""
    return op in save_ops and not draws_random(op, args, kwargs)


def _save_policy(save_ops: frozenset):
    def policy(ctx, op, *args, **kwargs):
        # Called for every op of the block, forward and recompute: most are not kept, and
        # answer without a further call (keeps() decides the same).
        if op not in save_ops or draws_random(op, args, kwargs):
            return CheckpointPolicy.PREFER_RECOMPUTE
        return CheckpointPolicy.MUST_SAVE
    return policy


# torch 2.14 asks selective checkpointing to choose whether the tensors it keeps pass through
# the saved-tensor hooks around it (offload, byte meters) and will flip its default later. We
# keep them out, as every torch before did: the plan, the meter and the offload were measured so.
_HOOKS_CHOICE = ({"respect_saved_tensors_hooks": False}
                 if "respect_saved_tensors_hooks" in inspect.signature(checkpoint).parameters
                 else {})


def _checkpointed_forward(original: Callable, context_fn: Callable | None, *args, **kwargs):
    extra = {"context_fn": context_fn, **_HOOKS_CHOICE} if context_fn is not None else {}
    # Non-reentrant: composes with FSDP2 hooks and keyword args; RNG state is stashed and
    # restored, so dropout masks in the recompute equal those of the forward.
    return checkpoint(original, *args, use_reentrant=False, preserve_rng_state=True, **extra,
                      **kwargs)


class _ReportSaved(TorchDispatchMode):
    """Reports the outputs of the ops selective checkpointing keeps to a SavedBytesMeter."""

    def __init__(self, save_ops: frozenset, meter: SavedBytesMeter):
        super().__init__()
        self.save_ops, self.meter = save_ops, meter

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if keeps(func, self.save_ops, args, kwargs or {}):
            for tensor in out if isinstance(out, (tuple, list)) else (out,):
                self.meter.add(tensor)
        return out


def _selective_contexts(save_ops: frozenset, policy: Callable,
                        meter: Optional[SavedBytesMeter]):
    forward_ctx, recompute_ctx = create_selective_checkpoint_contexts(policy)
    if meter is None or not meter.active:
        return forward_ctx, recompute_ctx
    # checkpoint() tells SAC's own mode its hooks choice; wrapped in our stack, it cannot.
    for attr, value in _HOOKS_CHOICE.items():
        setattr(forward_ctx, attr, value)
    stack = contextlib.ExitStack()
    stack.enter_context(forward_ctx)
    stack.enter_context(_ReportSaved(save_ops, meter))
    return stack, recompute_ctx


def checkpoint_block(block: nn.Module, recompute: str, save_ops: Sequence = (),
                     meter: Optional[SavedBytesMeter] = None) -> None:
    """Make `block` recompute in backward: "full" (keep only its inputs) or "selective".

    meter: where selective checkpointing reports what it keeps, when that is being measured.
    """
    if recompute in ("none", "compiler"):  # compiler: torch.compile places recompute itself
        return
    if getattr(block, "_blocktrain_recompute", None) is not None:
        raise RuntimeError(f"block already checkpointed ({block._blocktrain_recompute})")
    context_fn = None
    if recompute == "selective":
        ops = frozenset(save_ops)
        context_fn = functools.partial(_selective_contexts, ops, _save_policy(ops), meter)
    elif recompute != "full":
        raise ValueError(f"unknown recompute option {recompute!r}")
    original = block.forward
    block.forward = functools.partial(_checkpointed_forward, original, context_fn)
    block._blocktrain_recompute = recompute


def apply_checkpointing(blocks: Sequence[nn.Module], plan: Sequence[BlockPlan],
                        save_op_names: Sequence[str],
                        meter: Optional[SavedBytesMeter] = None) -> None:
    save_ops = resolve_ops(save_op_names) if any(p.recompute == "selective" for p in plan) else []
    for block, block_plan in zip(blocks, plan, strict=True):
        checkpoint_block(block, block_plan.recompute, save_ops, meter)
