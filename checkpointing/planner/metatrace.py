"""Measuring a model's activations on the meta device: bytes, not time, for any size of model.

Everything here runs on meta tensors, so an 80-layer 70B model at 8k tokens is measured in seconds
without a byte of real memory. Three kinds of numbers come out:

* per distinct block and recompute option: the bytes kept from forward to backward (the same
  SavedBytesMeter and checkpoint wrapper the trainer uses) and the peak bytes alive while the block
  runs (its working set, from a live-storage tracker over its forward and backward);
* for the part of the model after the last block (the output layer and the loss, "the head"): its
  saved bytes and how far its own forward and backward rise above them (logits and their
  gradients are the largest tensors of a language model at long sequence lengths);
* forward FLOPs per block, and how many of them each option recomputes.

Attention: on meta (and on CPU with dropout) `scaled_dot_product_attention` takes the math path,
which keeps T x T probabilities; no GPU kernel does. `FusedAttentionOnMeta` sends meta calls to the
CPU flash kernel, which keeps what flash, cuDNN and efficient attention keep (meta_attention.py);
the GPU kernel's backward workspace is added at its op (attention_workspace.py).
"""

from __future__ import annotations

import copy
import functools
import weakref
from dataclasses import dataclass, field
from typing import Any, Callable, Optional, Sequence

import torch
import torch.nn.functional as F
from torch import nn
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves, tree_map
from torch.utils.flop_counter import FlopCounterMode

from checkpointing.head import SeeInsideHead
from checkpointing.planner.attention_workspace import workspace_rule
from checkpointing.planner.meta_attention import ATTENTION_FLOPS
from checkpointing.planner.meta_attention import fused_on_meta, lower_right_on_meta
from checkpointing.planner.linear_flops import LinearFlops
from checkpointing.query_tiles import lower_right_attention
from checkpointing.planner.profile import OPTIONS, trace_on_meta
from checkpointing.meter import SavedBytesMeter
from checkpointing.wrap import checkpoint_block


class FusedAttentionOnMeta(TorchFunctionMode):
    """Runs meta `scaled_dot_product_attention` as a fused kernel (see the module docstring).

    Calls with an explicit mask keep the original path: the flash kernel takes no mask, and a
    masked call on a GPU runs the efficient kernel, which saves the mask as well.
    like_cpu: predict a CPU run instead, where attention with dropout takes the math path (T x T
    probabilities and the dropout mask kept); without dropout the CPU runs a flash kernel too.
    """

    def __init__(self, like_cpu: bool = False, attention: Optional[str] = None) -> None:
        super().__init__()
        self.like_cpu = like_cpu
        self.math = attention == "math"  # model.attention=math on a GPU: T x T kept, as meta

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        fused = (fused_on_meta(*args, like_cpu=self.like_cpu, **kwargs)
                 if func is F.scaled_dot_product_attention and not self.math else None)
        if fused is not None:
            return fused
        if func is lower_right_attention and args[0].device.type == "meta":
            return lower_right_on_meta(*args, like_cpu=self.like_cpu, **kwargs)
        return func(*args, **kwargs)


def fused_forward(forward: Callable, like_cpu: bool = False,
                  attention: Optional[str] = None) -> Callable:
    """`forward` under FusedAttentionOnMeta wherever it runs, recompute in backward included (a
    mode entered around `backward()` is off while it handles that call: math path inside)."""
    @functools.wraps(forward)
    def run(*args, **kwargs):
        with FusedAttentionOnMeta(like_cpu, attention):
            return forward(*args, **kwargs)
    return run


class _LiveBytes(TorchDispatchMode):
    """Bytes of the storages that ops create while active, and their peak, until each one dies.

    A storage counts from the op that allocates it until its last reference goes (a weakref
    finalizer; storages keep one Python object for their whole life). Outputs that alias an input
    (views, in-place and out= ops) allocate nothing and are not counted. Meta storages are never
    resized, so each size is read once. `workspace`: (op, args) -> bytes the GPU kernel standing
    behind that op allocates while it runs (attention_workspace.workspace_rule), counted at its
    peak and in `workspace_peak`.
    """

    def __init__(self, workspace: Optional[Callable[[Any, tuple], int]] = None) -> None:
        super().__init__()
        self.workspace, self.workspace_peak = workspace, 0
        self.current = self.peak = 0
        self._sizes: dict[int, int] = {}
        self._restart = False

    def reset_peak(self) -> None:
        self.peak = self.current

    def reset_peak_at_next_op(self) -> None:
        """For a reset inside a forward hook: the module's temporaries are freed only after its
        hooks have run, so the peak restarts at the next op instead."""
        self._restart = True

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if self._restart:
            self.peak, self._restart = self.current, False
        inputs = {t.untyped_storage()._cdata for t in tree_leaves((args, kwargs))
                  if isinstance(t, torch.Tensor)}
        for tensor in tree_leaves(out):
            if isinstance(tensor, torch.Tensor):
                storage = tensor.untyped_storage()
                key = storage._cdata
                if key not in inputs and key not in self._sizes:
                    self._sizes[key] = storage.nbytes()
                    self.current += self._sizes[key]
                    weakref.finalize(storage, self._release, key)
        extra = self.workspace(func, args) if self.workspace is not None else 0
        self.workspace_peak = max(self.workspace_peak, extra)
        self.peak = max(self.peak, self.current + extra)
        return out

    def _release(self, key: int) -> None:
        self.current -= self._sizes.pop(key, 0)


class LiveBytes(SeeInsideHead, _LiveBytes):
    """_LiveBytes that also sees inside the chunked head (one chunk's logits at a time)."""


@dataclass(frozen=True)
class BlockMeasure:
    """One block at its real input shapes, per recompute option."""

    saved_bytes: dict[str, int]  # kept from forward to backward
    peak_bytes: dict[str, int]  # most bytes alive while the block runs forward or backward,
    #                             its saved bytes and unsharded weight gradients included
    forward_flops: int
    recompute_flops: dict[str, int]  # FLOPs each option runs again in backward
    attention_flops: int = 0  # of forward_flops: attention's (causal) matmuls (step_time.py)
    storage_sizes: dict[str, tuple[int, ...]] = field(default_factory=dict)  # per option
    # Forward FLOPs of its sequence-tiled modules (checkpointing/tiles.py): their backward
    # recomputes them once more, tile by tile, whatever the block's own recompute option.
    tile_flops: int = 0
    workspace_bytes: int = 0  # the GPU attention kernel's backward workspace (in peak_bytes)
    frozen_flops: int = 0  # of forward_flops: frozen linears', one matmul in backward

    def step_flops(self) -> float:
        """Forward and backward (step_time.py's rule), without recompute and tiles."""
        return 3 * self.forward_flops + 0.5 * self.attention_flops - self.frozen_flops

    def small_bytes(self, option: str, min_bytes: int) -> int:
        """What stays on the device when `option`'s saved storages are offloaded."""
        return sum(n for n in self.storage_sizes.get(option, ()) if n < min_bytes)


@dataclass(frozen=True)
class HeadMeasure:
    """The part of the model after the last block (output layer and loss)."""

    saved_bytes: int
    extra_bytes: int  # the most its forward or backward holds above its saved bytes
    grad_param_names: tuple[str, ...]  # outside-block parameters whose gradients it produces


@dataclass(frozen=True)
class MetaProfile:
    block_names: tuple[str, ...]
    blocks: tuple[BlockMeasure, ...]  # identical blocks share one measurement
    rest_bytes: int  # saved outside all blocks (embedding stage + head), trace_on_meta's count
    head: HeadMeasure
    # Sequence parallelism: bytes one rank sends per block forward in Ulysses' all-to-alls
    # (the meta exchange the caller wrapped the model's attention with); 0 without.
    sent_bytes_per_block: int = 0
    attention_backend: Optional[str] = None  # the GPU kernel measured for (None: CPU's)
    attention_workspace_bytes: int = 0  # its backward workspace, the largest of one block
    # sharding.context: bytes sent to the ring's next rank per block, forward (K/V) and backward
    ring_sent_bytes_per_block: int = 0
    ring_backward_bytes_per_block: int = 0

    @property
    def before_blocks_bytes(self) -> int:
        """Saved outside the blocks and before them (the embedding stage): held to the end."""
        return max(0, self.rest_bytes - self.head.saved_bytes)


def _detached(x: Any) -> Any:
    """A leaf copy of a traced meta input, so backward stops at the block."""
    if isinstance(x, torch.Tensor):
        return x.detach().requires_grad_(x.requires_grad and x.is_floating_point())
    return x


def _clear_grads(module: nn.Module) -> None:
    for param in module.parameters():
        param.grad = None


class _Arriving(torch.autograd.Function):
    """The next block's gradient, made in backward and owned by autograd: it dies once used."""

    @staticmethod
    def forward(ctx, x: torch.Tensor) -> torch.Tensor:
        ctx.like = (x.shape, x.dtype, x.device)
        return x.new_zeros(())

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> torch.Tensor:
        return torch.ones(ctx.like[0], dtype=ctx.like[1], device=ctx.like[2])


def _backward_from(out: Any) -> None:
    outputs = [t for t in tree_leaves(out) if isinstance(t, torch.Tensor) and t.requires_grad]
    torch.autograd.backward([_Arriving.apply(t) for t in outputs])


def _distinct_bytes(tree: Any) -> int:
    storages = {t.untyped_storage()._cdata: t.untyped_storage().nbytes()
                for t in tree_leaves(tree) if isinstance(t, torch.Tensor)}
    return sum(storages.values())


def measure_block(block: nn.Module, args: tuple, kwargs: dict, save_ops: Sequence,
                  save_op_names: Sequence[str], like_cpu: bool = False,
                  attention: Optional[str] = None) -> BlockMeasure:
    """Saved and peak bytes per option, and FLOPs, of one block on meta (`attention`: the CUDA
    backend whose backward workspace counts, attention_workspace.py)."""
    args, kwargs = tree_map(_detached, (args, kwargs))
    input_bytes = _distinct_bytes((args, kwargs))
    saved, peak, sizes = {}, {}, {}
    for option in OPTIONS:
        candidate = copy.copy(block)  # shares the parameters, gets its own forward to wrap
        candidate.forward = fused_forward(candidate.forward, like_cpu, attention)
        meter = SavedBytesMeter()
        checkpoint_block(candidate, option, save_ops, meter)
        live = LiveBytes(workspace_rule(attention))
        with live:
            with meter.measure():
                out = candidate(*args, **kwargs)
            forward_peak = input_bytes + live.peak
            at_end = live.current
            live.reset_peak()
            _backward_from(out)
            # Relative to the end of forward: the block's own output is then the next block's
            # input, counted there, and it cancels out here.
            backward_peak = meter.bytes + live.peak - at_end
        del out
        _clear_grads(block)
        for leaf in tree_leaves((args, kwargs)):
            if isinstance(leaf, torch.Tensor):
                leaf.grad = None
        saved[option] = meter.bytes
        sizes[option] = tuple(meter.sizes)
        peak[option] = max(forward_peak, backward_peak)
    forward_flops, saved_op_flops, tile_flops, attention_flops, frozen = _forward_flops(
        block, args, kwargs, save_op_names, like_cpu)
    recompute = {"none": 0, "full": forward_flops,
                 "selective": max(0, forward_flops - saved_op_flops)}
    return BlockMeasure(saved_bytes=saved, peak_bytes=peak, forward_flops=forward_flops,
                        recompute_flops=recompute, storage_sizes=sizes, tile_flops=tile_flops,
                        attention_flops=attention_flops, frozen_flops=frozen,
                        workspace_bytes=live.workspace_peak)


def _forward_flops(block: nn.Module, args: tuple, kwargs: dict, save_op_names: Sequence[str],
                   like_cpu: bool = False) -> tuple[int, int, int, int, int]:
    """(all forward FLOPs, FLOPs of the ops selective checkpointing keeps, FLOPs inside its
    sequence-tiled modules, attention's FLOPs, frozen linears' FLOPs) of one block."""
    counter = FlopCounterMode(display=False, custom_mapping=ATTENTION_FLOPS)
    linears = LinearFlops(block)
    tiled = [m for m in block.modules() if (getattr(m, "_blocktrain_tiles", None) or 1) > 1]
    inside = [0, 0]  # (FLOPs counted when the tiled module started, FLOPs inside them)

    def started(module, args):
        inside[0] = counter.get_total_flops() + linears.unseen

    def ended(module, args, output):
        inside[1] += counter.get_total_flops() + linears.unseen - inside[0]

    handles = [h for m in tiled for h in (m.register_forward_pre_hook(started),
                                          m.register_forward_hook(ended))]
    try:
        with FusedAttentionOnMeta(like_cpu), counter, linears, torch.no_grad():
            block(*args, **kwargs)
    finally:
        for handle in handles:
            handle.remove()
    by_op = counter.get_flop_counts().get("Global", {})
    kept = set(save_op_names)
    saved_flops = sum(n for op, n in by_op.items() if getattr(op, "__name__", str(op)) in kept
                      or str(op).split(".")[-1] in kept)
    attention = sum(by_op.get(op, 0) for op in ATTENTION_FLOPS)
    total = counter.get_total_flops() + linears.unseen
    return total, saved_flops, inside[1], attention, linears.frozen


def _signature(block: nn.Module, args: tuple, kwargs: dict) -> tuple:
    def describe(x):
        return (tuple(x.shape), x.dtype, x.requires_grad) if isinstance(x, torch.Tensor) else x
    params = tuple((n, tuple(p.shape), p.dtype) for n, p in block.named_parameters())
    return type(block).__qualname__, params, str(tree_map(describe, (args, kwargs)))


def measure_head(model: nn.Module, blocks: Sequence[nn.Module],
                 run_forward: Callable[[nn.Module], torch.Tensor],
                 like_cpu: bool = False) -> HeadMeasure:
    """A whole forward on meta, measured only from the last block's output on.

    The last block's output is replaced by a detached leaf, so the backward runs the head alone.
    """
    live, meter = LiveBytes(), SavedBytesMeter()
    started = [False]

    def cut(module, args, output):
        started[0] = True
        leaf = tree_map(_detached, output)
        live.reset_peak_at_next_op()
        meter.active = True
        return leaf

    handle = blocks[-1].register_forward_hook(cut)
    try:
        with live:
            with FusedAttentionOnMeta(like_cpu), meter.measure():
                meter.active = False  # until the cut
                loss = run_forward(model)
            assert started[0], "the last block did not run"
            head_live_at_end = live.current
            forward_peak = live.peak
            live.reset_peak()
            loss.backward()
            backward_peak = live.peak
    finally:
        handle.remove()
    in_blocks = {id(p) for block in blocks for p in block.parameters()}
    names = tuple(name for name, p in model.named_parameters()
                  if id(p) not in in_blocks and p.grad is not None)
    _clear_grads(model)
    extra = max(forward_peak, backward_peak) - head_live_at_end
    return HeadMeasure(saved_bytes=meter.bytes, extra_bytes=max(0, extra), grad_param_names=names)


def profile_on_meta(model: nn.Module, block_names: Sequence[str], blocks: Sequence[nn.Module],
                    run_forward: Callable[[nn.Module], torch.Tensor], save_ops: Sequence,
                    save_op_names: Sequence[str], like_cpu: bool = False,
                    attention: Optional[str] = None) -> MetaProfile:
    """Everything the memory model needs about activations, from meta runs only.

    like_cpu: measure what a CPU run keeps (see FusedAttentionOnMeta); else a GPU's kernels.
    attention: the GPU's SDPA backend (model.attention resolved), whose workspace counts."""
    attention = None if like_cpu else attention
    with FusedAttentionOnMeta(like_cpu, attention):
        trace = trace_on_meta(model, blocks, run_forward)
    head = measure_head(model, blocks, run_forward, like_cpu)
    cache: dict[tuple, BlockMeasure] = {}
    measures = []
    for block, (args, kwargs) in zip(blocks, trace.block_args, strict=True):
        key = _signature(block, args, kwargs)
        if key not in cache:
            cache[key] = measure_block(block, args, kwargs, save_ops, save_op_names, like_cpu,
                                       attention)
        measures.append(cache[key])
    return MetaProfile(block_names=tuple(block_names), blocks=tuple(measures),
                       rest_bytes=trace.rest_saved_bytes, head=head, attention_backend=attention,
                       attention_workspace_bytes=max((m.workspace_bytes for m in measures),
                                                     default=0))


def cast_like_fsdp(model: nn.Module, blocks: Sequence[nn.Module], dtype: torch.dtype) -> list:
    """Make a meta model compute in `dtype` as FSDP2's MixedPrecisionPolicy(param_dtype) does
    under sharding/fsdp.py.

    FSDP2 all-gathers parameters in param_dtype; the root casts the model's floating inputs to
    it and each block only its hidden state (its first argument: rotary tables stay fp32). The
    meta model gets the same by converting its parameters and adding the same casts. Returns
    the hook handles.
    """
    model.to(dtype)

    def cast(x):
        return x.to(dtype) if isinstance(x, torch.Tensor) and x.is_floating_point() else x

    def cast_inputs(module, args, kwargs):
        return tree_map(cast, args), tree_map(cast, kwargs)

    def cast_hidden(module, args, kwargs):
        return (cast(args[0]), *args[1:]) if args else args, kwargs

    return [model.register_forward_pre_hook(cast_inputs, with_kwargs=True)] + [
        block.register_forward_pre_hook(cast_hidden, with_kwargs=True) for block in blocks]
