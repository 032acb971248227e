"""Sequence tiles: a token-wise function (an MLP; the built-in Llama's norm + projections, its
final norm) computed over slices of the sequence, forward and backward, so that its [tokens,
hidden] intermediates never exist for every token at once.

Forward runs the module tile by tile without autograd and keeps only its input. Backward
recomputes one tile at a time under autograd, back-propagates it at once and frees it, writing
the input gradient slice by slice and summing the weight gradients across tiles. The weight
gradients leave through this autograd node like any other input's, so they reach plain
parameters, DDP's and FSDP2's alike (FSDP2 sees its unsharded parameters' gradients appear).
Each tile's random state is recorded in forward and restored for its recompute, so dropout
inside the module draws the same masks twice.

The cost: one more forward of the module in backward (on top of any block recompute), and the
weight gradients' running sums.

Apply it to a module *inside* the FSDP unit (the MLP of a sharded block): its parameters must be
unsharded while backward recomputes it, which FSDP2 guarantees within the block's backward.
"""

from __future__ import annotations

import contextlib
import functools
from typing import Callable, Iterator, Optional, Sequence

import torch
from torch import nn

_LOW_PRECISION = (torch.bfloat16, torch.float16)


def tile_sizes(length: int, tiles: int) -> list[int]:
    """Token counts of `tiles` consecutive tiles of `length` tokens: as even as possible, the
    first length % tiles of them one token longer."""
    if tiles < 1:
        raise ValueError(f"tiles must be >= 1, got {tiles}")
    if tiles > length:
        raise ValueError(f"{tiles} tiles for {length} tokens: at most one tile per token")
    base, longer = divmod(length, tiles)
    return [base + 1] * longer + [base] * (tiles - longer)


# Under torch.compile the tiles run eagerly, forward and recompute alike: a compiled forward
# draws its dropout masks from inductor's generator, the recompute in backward from eager's, and
# the two would differ (wrong gradients without an error).
@torch.compiler.disable
def tiled(fn: Callable[..., torch.Tensor], x: torch.Tensor, num_tiles: int,
          params: Sequence[torch.Tensor], dim: int = 1,
          aligned: Sequence[tuple[torch.Tensor, int]] = ()) -> torch.Tensor:
    """fn(x) computed over `num_tiles` slices of `dim` (uneven sizes allowed: see tile_sizes).

    fn must be token-wise along `dim` (each output slice depends on the same input slice only)
    and keep that dim's size. params: the tensors fn reads that need gradients (a module's
    parameters at call time); their gradients are summed over the tiles. aligned: (tensor, its
    token dim) pairs that need no gradient, sliced like x and passed after it (rotary tables:
    fn(x_tile, cos_tile, sin_tile)).
    """
    sizes = tile_sizes(x.shape[dim], num_tiles)
    return _Tiled.apply(fn, tuple(sizes), dim % x.dim(), tuple(aligned), x, *params)


def _aligned(aligned: tuple, offset: int, size: int) -> list[torch.Tensor]:
    return [t.narrow(d, offset, size) for t, d in aligned]


class _Tiled(torch.autograd.Function):
    @staticmethod
    def forward(ctx, fn: Callable, sizes: tuple[int, ...], dim: int, aligned: tuple,
                x: torch.Tensor, *params: torch.Tensor) -> torch.Tensor:
        # Runs without autograd (as every Function.forward does): only each tile's output
        # lives, copied into the one output tensor.
        out: Optional[torch.Tensor] = None
        states = []
        offset = 0
        # A view of a leaf that requires grad still says so without autograd; module hooks
        # inside fn (FlopCounterMode's tracker) would try to hook its gradient.
        source = x.detach()
        for size in sizes:
            states.append(_rng_state(x.device))
            piece = fn(source.narrow(dim, offset, size), *_aligned(aligned, offset, size))
            if len(sizes) == 1:
                out = piece
                break
            if out is None:
                shape = list(piece.shape)
                shape[dim] = x.shape[dim]
                out = piece.new_empty(shape)
            out.narrow(dim, offset, size).copy_(piece)
            offset += size
        ctx.fn, ctx.sizes, ctx.dim, ctx.states, ctx.aligned = fn, sizes, dim, states, aligned
        # The parameters are held, not saved: saved tensors would pass through the offload
        # hooks, and FSDP2 refills these very tensors before backward.
        ctx.params = params
        ctx.save_for_backward(x)
        return out

    @staticmethod
    def backward(ctx, grad_out: torch.Tensor):
        (x,) = ctx.saved_tensors
        want_x = ctx.needs_input_grad[4]
        wanted = [i for i, need in enumerate(ctx.needs_input_grad[5:]) if need]
        params = [ctx.params[i] for i in wanted]
        whole = len(ctx.sizes) == 1  # one tile: its input gradient is the whole one
        grad_x = torch.empty_like(x) if want_x and not whole else None
        sums: list[Optional[torch.Tensor]] = [None] * len(params)
        offset = 0
        for size, state in zip(ctx.sizes, ctx.states):
            tile = x.narrow(ctx.dim, offset, size).detach().requires_grad_(want_x)
            with torch.enable_grad(), _restored_rng(state, x.device):
                piece = ctx.fn(tile, *_aligned(ctx.aligned, offset, size))
            inputs = [tile, *params] if want_x else params
            grads = torch.autograd.grad(piece, inputs, grad_out.narrow(ctx.dim, offset, size),
                                        allow_unused=True)
            del piece
            if want_x:
                if whole:
                    grad_x = grads[0]
                else:
                    grad_x.narrow(ctx.dim, offset, size).copy_(grads[0])
                grads = grads[1:]
            for i, grad in enumerate(grads):
                sums[i] = _accumulate(sums[i], grad)
            del grads  # this tile's weight gradients, before the next tile makes its own
            offset += size
        if params and all(s is None for s in sums):
            raise RuntimeError("tiled: the recompute used none of the parameters passed; under "
                               "FSDP, tile a module inside the sharded one")
        param_grads: list[Optional[torch.Tensor]] = [None] * len(ctx.params)
        for i, total in zip(wanted, sums):
            param_grads[i] = None if total is None else total.to(ctx.params[i].dtype)
        return (None, None, None, None, grad_x, *param_grads)


def _accumulate(total: Optional[torch.Tensor], grad: Optional[torch.Tensor]):
    """Sum tile gradients, in float32 for 16-bit ones (a bf16 running sum loses the small
    tiles' contributions)."""
    if grad is None:
        return total
    if total is None:
        return grad.float() if grad.dtype in _LOW_PRECISION else grad
    return total.add_(grad)


def _rng_state(device: torch.device) -> tuple:
    cpu = torch.get_rng_state()
    if device.type == "cuda":
        return cpu, torch.cuda.get_rng_state(device)
    return cpu, None


@contextlib.contextmanager
def _restored_rng(state: tuple, device: torch.device) -> Iterator[None]:
    """Run with the random state `state`, then put back the state found on entry: backward's
    recompute must not move the generator the rest of training draws from."""
    cpu, accelerator = state
    found = _rng_state(device)
    torch.set_rng_state(cpu)
    if accelerator is not None:
        torch.cuda.set_rng_state(accelerator, device)
    try:
        yield
    finally:
        torch.set_rng_state(found[0])
        if found[1] is not None:
            torch.cuda.set_rng_state(found[1], device)


def _tiled_forward(module: nn.Module, original: Callable, num_tiles: int, dim: int,
                   x: torch.Tensor) -> torch.Tensor:
    # Read at every call: FSDP2 swaps in the unsharded parameters for the forward.
    params = [p for p in module.parameters() if p.requires_grad]
    return tiled(original, x, num_tiles, params, dim)


def tile_module(module: nn.Module, num_tiles: int, dim: int = 1) -> nn.Module:
    """Make `module` (token-wise, called with one tensor) compute in `num_tiles` sequence tiles.

    Its own `forward` is replaced on that instance, as checkpointing/wrap.py does for blocks:
    the module tree and parameter names stay as written (checkpoints still map by name).
    num_tiles=1 leaves the module as it is. Returns the module.
    """
    mark_tiled(module, num_tiles)
    if num_tiles > 1:
        module.forward = functools.partial(_tiled_forward, module, module.forward, num_tiles,
                                           dim)
    return module


def mark_tiled(module: nn.Module, num_tiles: int) -> None:
    """Say that `module` runs inside sequence tiles of `num_tiles` (tile_module, or a model
    that calls `tiled` itself): the planner's trace counts its FLOPs as the tiles' recompute.
    Refuses a module marked already."""
    if num_tiles < 1:
        raise ValueError(f"tiles must be >= 1, got {num_tiles}")
    if getattr(module, "_blocktrain_tiles", None) is not None:
        raise RuntimeError(f"module already tiled ({module._blocktrain_tiles} tiles)")
    module._blocktrain_tiles = num_tiles


def apply_tiles(blocks: Sequence[nn.Module], plan: Sequence,
                tile_block: Callable[[nn.Module, int], bool]) -> int:
    """Carry out the plan's `tiles`: block i computes its token-wise parts in plan[i].tiles
    sequence tiles, by `tile_block(block, tiles)` (its family's: which parts, False for none).
    Before the block's checkpoint wrapper and fully_shard, so its recompute and FSDP's unshard
    window hold the tiles inside. Returns the blocks tiled."""
    tiled_count = 0
    for block, block_plan in zip(blocks, plan, strict=True):
        if block_plan.tiles == 1:
            continue
        if not tile_block(block, block_plan.tiles):
            raise ValueError(f"checkpointing.tiles: block {block_plan.name} has no token-wise "
                             "MLP to tile; set checkpointing.tiles=1")
        tiled_count += 1
    return tiled_count
