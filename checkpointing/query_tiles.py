"""Query tiles: causal attention (and what comes with each query, rotary before and the output
projection after) computed a tile of queries at a time, each tile against its causal key prefix,
forward and backward, so that nothing of a query's side exists for every token at once: not its
fp32 rotary copy, not the attention output, not the GPU kernel's backward workspace (the fp32 dq
accumulator is per query tile; see checkpointing/planner/attention_workspace.py).

Forward runs the tiles without autograd and keeps the inputs only (the query source, the rotated
keys and the values). Backward recomputes one tile at a time under autograd and back-propagates
it at once: the query gradient is written slice by slice, the key and value gradients and the
weight gradients are summed over the tiles (in float32 for 16-bit tensors, as checkpointing/
tiles.py sums weight gradients). Each tile's random state is recorded in forward and restored for
its recompute. The cost: one more forward of the tiles in backward, as for sequence tiles.

Tile i of queries [s, e) attends keys [0, e): the prefix its causal mask allows, with the mask
aligned to the bottom right (query s + j sees keys up to s + j). The caller's `tile_fn` does the
attention itself, through `lower_right_attention` for unpacked rows.
"""

from __future__ import annotations

import contextlib
from typing import Callable, Iterator, Optional, Sequence

import torch
import torch.nn.functional as F
from torch.overrides import (_get_current_function_mode_stack, handle_torch_function,
                             has_torch_function)

from checkpointing.tiles import _accumulate, _aligned, _restored_rng, _rng_state, tile_sizes

_LOW_PRECISION = (torch.bfloat16, torch.float16)


def lower_right_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                          enable_gqa: bool = False) -> torch.Tensor:
    """Attention of [B, heads, t, d] queries, the last t of k's e tokens, under a causal mask
    aligned to the bottom right (query j sees keys up to e - t + j).

    On a GPU with 16-bit inputs, FlashAttention-2's own causal mask, which is bottom-right
    aligned when t < e (sdp_utils.cpp refuses it for is_causal there only to keep SDPA's
    top-left meaning). On the CPU, its flash kernel with an additive mask of t + e - 1 values
    (`cpu_mask`): the queries run in reverse order, so that whether query row r may see key j
    depends on r + j only, which a [t, e] view with strides (1, 1) of one row expresses. A GPU
    in float32 runs SDPA (the memory-efficient kernel) with a boolean [t, e] mask.
    Overridable (a TorchFunctionMode sees the call), so the meta trace stands it in for the
    kernel it predicts (checkpointing/planner/meta_attention.py)."""
    if has_torch_function((q, k, v)):
        return handle_torch_function(lower_right_attention, (q, k, v), q, k, v,
                                     enable_gqa=enable_gqa)
    tokens, prefix = q.shape[-2], k.shape[-2]
    if q.device.type == "cpu":
        flipped, _ = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
            q.flip(-2), k, v, 0.0, False, attn_mask=cpu_mask(tokens, prefix, q))
        return flipped.flip(-2)
    if q.dtype in _LOW_PRECISION and q.shape[-1] <= 256 and torch.backends.cuda.flash_sdp_enabled():
        return torch.ops.aten._scaled_dot_product_flash_attention(q, k, v, 0.0, True)[0]
    allowed = torch.ones(tokens, prefix, dtype=torch.bool, device=q.device).tril(prefix - tokens)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=allowed, enable_gqa=enable_gqa)


def cpu_mask(tokens: int, prefix: int, like: torch.Tensor) -> torch.Tensor:
    """The [tokens, prefix] additive mask of reversed query rows: row r (query tokens - 1 - r)
    sees keys j with r + j < prefix. One row of tokens + prefix - 1 values, viewed."""
    row = torch.full((tokens + prefix - 1,), float("-inf"), dtype=like.dtype, device=like.device)
    row[:prefix] = 0
    return row.as_strided((tokens, prefix), (1, 1))


@torch.compiler.disable  # as sequence tiles: the recompute must draw the forward's masks
def query_tiled(tile_fn: Callable[..., torch.Tensor], q_src: torch.Tensor, k: torch.Tensor,
                v: torch.Tensor, num_tiles: int, params: Sequence[torch.Tensor],
                aligned: Sequence[tuple[torch.Tensor, int]] = ()) -> torch.Tensor:
    """out[:, s:e] = tile_fn(q_src[:, s:e], k[:, :, :e], v[:, :, :e], *aligned[s:e]) for each
    of `num_tiles` query tiles [s, e) of dim 1 of q_src ([B, T, ...]); k and v are [B, heads,
    T, head_dim] (tokens on dim 2). params: what tile_fn reads that needs gradients; aligned:
    (tensor, token dim) pairs without gradients, sliced with the queries (rotary tables, mask
    rows)."""
    sizes = tile_sizes(q_src.shape[1], num_tiles)
    return _QueryTiled.apply(tile_fn, tuple(sizes), tuple(aligned), q_src, k, v, *params)


class _QueryTiled(torch.autograd.Function):
    @staticmethod
    def forward(ctx, fn: Callable, sizes: tuple[int, ...], aligned: tuple, q_src: torch.Tensor,
                k: torch.Tensor, v: torch.Tensor, *params: torch.Tensor) -> torch.Tensor:
        out: Optional[torch.Tensor] = None
        states, offset = [], 0
        queries, keys, values = q_src.detach(), k.detach(), v.detach()
        for size in sizes:
            states.append(_rng_state(q_src.device))
            end = offset + size
            piece = fn(queries.narrow(1, offset, size), keys.narrow(2, 0, end),
                       values.narrow(2, 0, end), *_aligned(aligned, offset, size))
            if out is None:
                out = piece.new_empty((piece.shape[0], q_src.shape[1], *piece.shape[2:]))
            out.narrow(1, offset, size).copy_(piece)
            del piece
            offset = end
        ctx.fn, ctx.sizes, ctx.aligned, ctx.states = fn, sizes, aligned, states
        ctx.modes = _get_current_function_mode_stack()
        ctx.params = params  # held, not saved: FSDP2 refills these tensors before backward
        ctx.save_for_backward(q_src, k, v)
        return out

    @staticmethod
    def backward(ctx, grad_out: torch.Tensor):
        q_src, k, v = ctx.saved_tensors
        want = ctx.needs_input_grad[3:6]
        wanted = [i for i, need in enumerate(ctx.needs_input_grad[6:]) if need]
        params = [ctx.params[i] for i in wanted]
        grad_q = torch.empty_like(q_src) if want[0] else None
        grad_k = _zeros_for(k) if want[1] else None
        grad_v = _zeros_for(v) if want[2] else None
        sums: list[Optional[torch.Tensor]] = [None] * len(params)
        offset = 0
        for size, state in zip(ctx.sizes, ctx.states):
            end = offset + size
            leaves = [q_src.narrow(1, offset, size).detach().requires_grad_(want[0]),
                      k.narrow(2, 0, end).detach().requires_grad_(want[1]),
                      v.narrow(2, 0, end).detach().requires_grad_(want[2])]
            with _entered(ctx.modes), torch.enable_grad(), _restored_rng(state, q_src.device):
                piece = ctx.fn(*leaves, *_aligned(ctx.aligned, offset, size))
            inputs = [leaf for leaf, need in zip(leaves, want) if need] + params
            grads = list(torch.autograd.grad(piece, inputs, grad_out.narrow(1, offset, size),
                                             allow_unused=True))
            del piece
            for need, total, dim, length in zip(want, (grad_q, grad_k, grad_v), (1, 2, 2),
                                                (size, end, end)):
                if not need:
                    continue
                grad = grads.pop(0)
                target = total.narrow(dim, offset if dim == 1 else 0, length)
                if dim == 1:  # this tile's own queries: written once
                    target.copy_(grad) if grad is not None else target.zero_()
                elif grad is not None:  # the key prefix: every later tile adds to it
                    target.add_(grad)
            for i, grad in enumerate(grads):
                sums[i] = _accumulate(sums[i], grad)
            del grads
            offset = end
        param_grads: list[Optional[torch.Tensor]] = [None] * len(ctx.params)
        for i, total in zip(wanted, sums):
            param_grads[i] = None if total is None else total.to(ctx.params[i].dtype)
        return (None, None, None, grad_q, _cast(grad_k, k), _cast(grad_v, v), *param_grads)


@contextlib.contextmanager
def _entered(modes: list) -> Iterator[None]:
    """The torch-function modes the forward ran under, for the recompute: the meta trace's
    stand-in for the GPU's attention (metatrace.FusedAttentionOnMeta) is one, which a mode
    entered around backward() could not be (it is off while it handles that call)."""
    with contextlib.ExitStack() as stack:
        for mode in modes:
            stack.enter_context(mode)
        yield


def _zeros_for(t: torch.Tensor) -> torch.Tensor:
    """A running sum over the tiles, in float32 for a 16-bit tensor (a bf16 sum loses the small
    tiles' contributions)."""
    return torch.zeros(t.shape, dtype=torch.float32 if t.dtype in _LOW_PRECISION else t.dtype,
                       device=t.device)


def _cast(total: Optional[torch.Tensor], like: torch.Tensor) -> Optional[torch.Tensor]:
    return None if total is None else total.to(like.dtype)
