"""Selective checkpointing never keeps an op that draws random numbers (issue 29, item 7).

A kept op is skipped when the block is recomputed, so the random generator is not advanced as it
was in forward and every later dropout mask of the block shifts: wrong gradients, no error. On a
GPU the fused attention kernels draw their dropout mask inside the op the default save list
keeps. No CPU attention kernel does (torch 2.13's CPU flash kernel refuses dropout_p > 0, and
SDPA then takes the math path, where dropout is an op of its own), so on CPU a custom op stands
in for one: one op, tagged as drawing random numbers, with a `dropout_p` argument, as they are.
The GPU check's parity stage runs the real kernels (a bf16 row: fp32 with grouped heads takes
the math path on CUDA too).
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from checkpointing.plan import DEFAULT_SAVE_OPS
from checkpointing.wrap import checkpoint_block, draws_random, resolve_ops

DIM = 16
CALLS: list[float] = []  # dropout_p of every run of the stand-in op, forward and recompute


@torch.library.custom_op("blocktrain_test::dropout_matmul", mutates_args=(),
                         tags=(torch.Tag.nondeterministic_seeded,))
def dropout_matmul(x: torch.Tensor, w: torch.Tensor,
                   dropout_p: float) -> tuple[torch.Tensor, torch.Tensor]:
    """x @ w with dropout drawn inside the op, as a fused attention kernel draws its mask."""
    CALLS.append(dropout_p)
    out = x @ w
    mask = torch.bernoulli(torch.full_like(out, 1.0 - dropout_p))
    return out * mask / (1.0 - dropout_p), mask


def _setup(ctx, inputs, output) -> None:
    x, w, dropout_p = inputs
    ctx.save_for_backward(x, w, output[1])
    ctx.scale = 1.0 / (1.0 - dropout_p)


def _backward(ctx, grad_out, _grad_mask):
    x, w, mask = ctx.saved_tensors
    grad = grad_out * mask * ctx.scale
    return grad @ w.t(), x.t() @ grad, None


dropout_matmul.register_autograd(_backward, setup_context=_setup)
OP = torch.ops.blocktrain_test.dropout_matmul.default


class Block(nn.Module):
    """The fused op, then a dropout of its own that draws after it (a residual dropout)."""

    def __init__(self, dropout: float, dtype: torch.dtype) -> None:
        super().__init__()
        self.dropout = dropout
        self.w = nn.Parameter(torch.randn(DIM, DIM, dtype=dtype) * 0.3)
        self.drop = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y, _ = OP(x, self.w, self.dropout)
        return x + self.drop(torch.tanh(y))


def _grads(recompute: str, dropout: float, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    torch.manual_seed(0)
    blocks = nn.Sequential(Block(dropout, dtype), Block(dropout, dtype))
    save_ops = [OP, *resolve_ops(DEFAULT_SAVE_OPS)]  # the defaults, and the stand-in kept too
    for block in blocks:
        checkpoint_block(block, recompute, save_ops)
    x = torch.randn(8, DIM, dtype=dtype, generator=torch.Generator().manual_seed(1))
    torch.manual_seed(2)  # the same masks for every recompute option
    blocks(x).float().square().mean().backward()
    return {name: p.grad for name, p in blocks.named_parameters()}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_selective_recomputes_a_kept_op_that_draws_dropout(dtype) -> None:
    reference = _grads("none", 0.25, dtype)
    CALLS.clear()
    got = _grads("selective", 0.25, dtype)
    for name, grad in reference.items():
        assert torch.equal(got[name], grad), name
    assert CALLS == [0.25] * 4  # each block's op ran again in recompute


def test_selective_still_keeps_the_op_when_it_draws_nothing() -> None:
    reference = _grads("none", 0.0, torch.float32)
    CALLS.clear()
    got = _grads("selective", 0.0, torch.float32)
    assert all(torch.equal(got[n], g) for n, g in reference.items())
    assert CALLS == [0.0] * 2  # forward only: recompute took the kept output


def test_the_fused_attention_kernels_are_recognised_by_their_dropout_argument() -> None:
    """The CUDA kernels of the default save list, by their schemas (nothing runs here)."""
    flash = torch.ops.aten._scaled_dot_product_flash_attention.default  # dropout_p: 4th
    efficient = torch.ops.aten._scaled_dot_product_efficient_attention.default  # 6th
    qkv = (None, None, None)
    assert draws_random(flash, (*qkv, 0.1, True), {})
    assert not draws_random(flash, (*qkv, 0.0, True), {})
    assert not draws_random(flash, qkv, {})  # the schema's default: no dropout
    assert draws_random(efficient, (*qkv, None, True, 0.1, True), {})
    assert not draws_random(efficient, (*qkv, None, True), {"dropout_p": 0.0})
    assert not draws_random(torch.ops.aten.mm.default, (None, None), {})
    assert draws_random(torch.ops.aten.native_dropout.default, (None, 0.1, True), {})
