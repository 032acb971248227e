"""Profiling blocks for the planner: saved bytes and added time of each recompute option.

The block inputs come from one forward of the whole model on the meta device (no memory), so the
profile uses the real batch and sequence shapes whatever the model. Each *distinct* block (same
class, parameter shapes and input shapes) is then materialised once on the compute device and
run forward and backward under each option.
"""

from __future__ import annotations

import copy
import time
from dataclasses import dataclass, field, replace
from typing import Any, Callable, Optional, Sequence

import torch
from torch import nn
from torch.utils._pytree import tree_map

from checkpointing.compiled import compile_block
from checkpointing.meter import SavedBytesMeter
from checkpointing.wrap import checkpoint_block

OPTIONS = ("none", "selective", "full")


@dataclass(frozen=True)
class BlockProfile:
    saved_bytes: dict[str, int]  # per option: bytes kept from forward to backward
    cost_s: dict[str, float]  # per option: seconds added to forward+backward (recompute)
    compute_s: float = 0.0  # forward+backward of the block as it is (transfers can hide here)
    storage_sizes: dict[str, tuple[int, ...]] = field(default_factory=dict)  # per option
    # Per option: bytes alive while the block runs (its working set), from the memory model's
    # meta measurement (checkpointing/planner/metatrace.py); empty: not measured.
    working_bytes: dict[str, int] = field(default_factory=dict)
    # With the "compiler" option: the partitioner's activation_memory_budget it was measured at.
    compiler_budget: Optional[float] = None

    def small_bytes(self, option: str, min_bytes: int) -> int:
        """What stays on the device when `option`'s saved storages are offloaded."""
        return sum(n for n in self.storage_sizes.get(option, ()) if n < min_bytes)

    def peak_of(self, option: str) -> int:
        """Bytes alive while the block's backward runs under `option`: the measured working set,
        else (not measured) everything it would keep without checkpointing."""
        return self.working_bytes.get(option, self.saved_bytes["none"])

    @property
    def peak_bytes(self) -> int:
        return self.peak_of("none")


@dataclass
class ModelTrace:
    block_args: list[tuple[tuple, dict]]  # meta tensors each block received
    rest_saved_bytes: int  # what the model keeps outside its blocks (embeddings, head, loss)


def trace_on_meta(model: nn.Module, blocks: Sequence[nn.Module],
                  run_forward: Callable[[nn.Module], torch.Tensor]) -> ModelTrace:
    """One forward on the meta device: each block's inputs, and the bytes kept outside blocks."""
    meter = SavedBytesMeter()
    captured: list[Any] = [None] * len(blocks)
    depth = [0]

    def enter(index):
        def hook(module, args, kwargs):
            captured[index] = (args, kwargs)
            depth[0] += 1
            meter.active = False  # saved inside a block: the block's own profile counts it
        return hook

    def leave(module, args, kwargs, output):
        depth[0] -= 1
        meter.active = depth[0] == 0

    handles = []
    for i, block in enumerate(blocks):
        handles.append(block.register_forward_pre_hook(enter(i), with_kwargs=True))
        handles.append(block.register_forward_hook(leave, with_kwargs=True))
    try:
        with meter.measure():
            run_forward(model)
    finally:
        for h in handles:
            h.remove()
    return ModelTrace(block_args=captured, rest_saved_bytes=meter.bytes)


def _signature(block: nn.Module, args: tuple, kwargs: dict) -> tuple:
    def describe(x):
        return (tuple(x.shape), x.dtype, x.requires_grad) if isinstance(x, torch.Tensor) else x
    params = tuple((n, tuple(p.shape), p.dtype) for n, p in block.named_parameters())
    return (type(block).__qualname__, params, str(tree_map(describe, (args, kwargs))))


def _real_like(x, device: torch.device, generator: torch.Generator):
    if not isinstance(x, torch.Tensor):
        return x
    if x.is_floating_point():
        real = torch.randn(x.shape, dtype=x.dtype, device=device, generator=generator)
        return real.requires_grad_(x.requires_grad)
    return torch.zeros(x.shape, dtype=x.dtype, device=device)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _materialise(block: nn.Module, args: tuple, kwargs: dict, device: torch.device):
    generator = torch.Generator(device=device).manual_seed(0)
    real = copy.deepcopy(block).to_empty(device=device)
    with torch.no_grad():
        for p in real.parameters():
            p.normal_(0.0, 0.02, generator=generator)
    return real, tree_map(lambda x: _real_like(x, device, generator), (args, kwargs))


def _measure(candidates: dict[str, nn.Module], args: tuple, kwargs: dict, device: torch.device,
             repeats: int):
    """Per candidate: saved bytes, saved storage sizes, best seconds of forward+backward; and
    the best forward seconds of "none". Candidates take turns, after one untimed round:
    allocator and thread-pool warm-up (and compiling) would otherwise be charged to whichever
    ran first."""
    saved, sizes = {}, {}
    seconds = {option: float("inf") for option in candidates}
    forward_s, grad = float("inf"), True
    for attempt in range(repeats + 1):
        for option, candidate in candidates.items():
            _sync(device)
            started = time.perf_counter()
            with candidate._profile_meter.measure() as meter:
                out = candidate(*args, **kwargs)
            _sync(device)
            forward_done = time.perf_counter()
            grad = out.requires_grad
            if grad:  # a frozen block fed by frozen layers has no backward
                out.float().square().mean().backward()
            _sync(device)
            saved[option] = meter.bytes
            sizes[option] = tuple(meter.sizes)
            if attempt > 0:
                seconds[option] = min(seconds[option], time.perf_counter() - started)
                if option == "none":
                    forward_s = min(forward_s, forward_done - started)
    # No backward: nothing is ever recomputed.
    return saved, sizes, seconds, forward_s if grad else 0.0


def profile_block(block: nn.Module, args: tuple, kwargs: dict, device: torch.device,
                  save_ops: Sequence, repeats: int,
                  compile_backend: Optional[str] = None) -> BlockProfile:
    """Saved bytes and added seconds for each option, for one block at its real input shapes.

    compile_backend: measure each option compiled, as train.compile runs it (what the compiled
    backward keeps differs from eager: selective checkpointing can keep much more).
    """
    real, (real_args, real_kwargs) = _materialise(block, args, kwargs, device)
    candidates = {option: _wrapped_copy(real, option, save_ops, compile_backend)
                  for option in OPTIONS}
    saved, sizes, seconds, forward_s = _measure(candidates, real_args, real_kwargs, device,
                                                repeats)
    base = seconds["none"]
    # Full recomputation repeats exactly one forward, so its cost is the forward's own time
    # rather than a difference of two noisy totals (which a loaded machine can make <= 0).
    # Selective recomputes part of that forward: its difference, kept within [0, forward].
    cost = {"none": 0.0, "full": forward_s,
            "selective": min(forward_s, max(0.0, seconds["selective"] - base))}
    return BlockProfile(saved_bytes=saved, cost_s=cost, compute_s=base, storage_sizes=sizes)


def with_compiler_option(blocks: Sequence[nn.Module], trace: ModelTrace, device: torch.device,
                         profiles: Sequence[BlockProfile], budgets: Sequence[float],
                         compile_backend: str, repeats: int) -> list[BlockProfile]:
    """Each profile with a fourth option, "compiler": the block compiled without a checkpoint,
    the partitioner placing recompute under its activation_memory_budget (`budgets`, one per
    block), measured beside compiled "none". Its working set is taken as that of "none"."""
    cache: dict[tuple, BlockProfile] = {}
    out = []
    with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
        for block, (args, kwargs), p, budget in zip(blocks, trace.block_args, profiles, budgets,
                                                    strict=True):
            key = (_signature(block, args, kwargs), budget)
            if key not in cache:
                real, (real_args, real_kwargs) = _materialise(block, args, kwargs, device)
                candidates = {"none": _wrapped_copy(real, "none", (), compile_backend),
                              "compiler": _wrapped_copy(real, "none", (), compile_backend, budget)}
                saved, sizes, seconds, forward_s = _measure(candidates, real_args, real_kwargs,
                                                            device, repeats)
                cost = min(forward_s, max(0.0, seconds["compiler"] - seconds["none"]))
                working = ({**p.working_bytes, "compiler": p.working_bytes["none"]}
                           if "none" in p.working_bytes else p.working_bytes)
                cache[key] = replace(
                    p, saved_bytes={**p.saved_bytes, "compiler": saved["compiler"]},
                    cost_s={**p.cost_s, "compiler": cost},
                    storage_sizes={**p.storage_sizes, "compiler": sizes["compiler"]},
                    working_bytes=working, compiler_budget=budget)
            out.append(cache[key])
    return out


def _wrapped_copy(real: nn.Module, option: str, save_ops: Sequence,
                  compile_backend: Optional[str], memory_budget: Optional[float] = None
                  ) -> nn.Module:
    # A shallow copy shares the parameters but gets its own forward to wrap.
    candidate = copy.copy(real)
    meter = SavedBytesMeter()
    if compile_backend is None:
        checkpoint_block(candidate, option, save_ops, meter)
    else:  # the compiled graph's saved tensors pass the meter's hooks, its cache included
        checkpoint_block(candidate, option, save_ops)
        compile_block(candidate, compile_backend, memory_budget)
    candidate._profile_meter = meter
    return candidate


def profile_blocks(blocks: Sequence[nn.Module], trace: ModelTrace, device: torch.device,
                   save_ops: Sequence, repeats: int,
                   compile_backend: Optional[str] = None) -> list[BlockProfile]:
    """A profile per block; identical blocks share one measurement."""
    cache: dict[tuple, BlockProfile] = {}
    profiles = []
    # Profiling runs dropout; the training run's random stream must not notice it happened.
    with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
        for block, (args, kwargs) in zip(blocks, trace.block_args, strict=True):
            key = _signature(block, args, kwargs)
            if key not in cache:
                cache[key] = profile_block(block, args, kwargs, device, save_ops, repeats,
                                           compile_backend)
            profiles.append(cache[key])
    return profiles
