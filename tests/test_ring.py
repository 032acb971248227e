"""Ring attention (sharding/ring.py) against whole-sequence attention, on 2 and 4 gloo ranks.

Every rank computes the whole attention for reference from the same seeded tensors, runs the
ring on its balanced slice, and returns both slices' outputs and gradients: the test compares
them (the softmax merge reorders sums: 1e-5, fp32).
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from sharding.ring import (balanced_positions, balanced_slice, balanced_unslice, document_mask,
                           ring_attention, step_shape)
from tests.dist import spawn

CASES = {  # name: (query heads, kv heads, causal, packed)
    "causal": (4, 4, True, False),
    "gqa": (4, 2, True, False),
    "full": (2, 2, False, False),
    "packed": (4, 2, True, True),
}


def _inputs(length: int, q_heads: int, kv_heads: int, packed: bool):
    gen = torch.Generator().manual_seed(7)
    q = torch.randn(2, q_heads, length, 8, generator=gen)
    k, v = (torch.randn(2, kv_heads, length, 8, generator=gen) for _ in range(2))
    grad = torch.randn(2, q_heads, length, 8, generator=gen)
    docs = None
    if packed:  # documents of uneven lengths, crossing chunk and rank borders
        cuts = torch.tensor([[0, 5, 6, 19, 30], [0, 11, 12, 13, 27]])
        docs = torch.stack([torch.bucketize(torch.arange(length), row, right=True) for row in cuts])
    return q, k, v, grad, docs


def _whole(q, k, v, causal, docs):
    groups = q.shape[1] // k.shape[1]
    k, v = (t.repeat_interleave(groups, dim=1) for t in (k, v))
    if docs is None:
        return F.scaled_dot_product_attention(q, k, v, is_causal=causal)
    pos = torch.arange(q.shape[2])
    mask = document_mask(pos, pos, docs, docs, q.dtype)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)


def _case(rank: int, world: int, name: str, length: int) -> dict:
    q_heads, kv_heads, causal, packed = CASES[name]
    q, k, v, grad, docs = _inputs(length, q_heads, kv_heads, packed)
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    _whole(*leaves, causal, docs).backward(grad)
    mine = [balanced_slice(t.detach(), rank, world, dim=2).requires_grad_() for t in (q, k, v)]
    local_docs = balanced_slice(docs, rank, world, dim=1) if docs is not None else None
    out = ring_attention(*mine, dist.group.WORLD, causal=causal, documents=local_docs)
    out.backward(balanced_slice(grad, rank, world, dim=2))
    return {"out": out.detach(), "grads": [t.grad for t in mine],
            "whole_out": balanced_slice(_whole(q, k, v, causal, docs), rank, world, dim=2),
            "whole_grads": [balanced_slice(t.grad, rank, world, dim=2) for t in leaves]}


def _close(got: torch.Tensor, expected: torch.Tensor) -> None:
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)


def _run(world: int) -> dict:
    return {name: _case(dist.get_rank(), world, name, 32) for name in CASES}


def _run_spawned(rank: int, world: int) -> dict:
    return _run(world)


@pytest.fixture(scope="module")
def two() -> list[dict]:
    return spawn(_run_spawned, 2)


@pytest.mark.parametrize("name", sorted(CASES))
def test_ring_of_two_is_whole_attention(two, name) -> None:
    for rank in two:
        got = rank[name]
        _close(got["out"], got["whole_out"])
        for grad, expected in zip(got["grads"], got["whole_grads"]):
            _close(grad, expected)


def test_ring_of_four_is_whole_attention() -> None:
    for rank in spawn(_run_spawned, 4):
        for got in rank.values():
            _close(got["out"], got["whole_out"])
            for grad, expected in zip(got["grads"], got["whole_grads"]):
                _close(grad, expected)


def test_balanced_slices_cover_the_sequence_once() -> None:
    x = torch.arange(48)[None]
    parts = [balanced_slice(x, rank, 3) for rank in range(3)]
    assert parts[0].tolist() == [[*range(0, 8), *range(40, 48)]]
    assert torch.equal(balanced_unslice(parts), x)
    assert torch.equal(balanced_positions(48, 1, 3), parts[1][0])
    with pytest.raises(ValueError, match="does not split into 6 equal chunks"):
        balanced_slice(torch.arange(40)[None], 0, 3)


def test_every_step_does_the_same_work_on_every_rank() -> None:
    """The balance the layout is for: count query-key pairs each rank computes per step."""
    size, local = 4, 8
    work = [[0] * size for _ in range(size)]
    for rank in range(size):
        for step in range(size):
            source = (rank - step) % size
            shape = step_shape(rank, source, local, causal=True)
            if shape is not None:
                rows = shape.queries.stop - shape.queries.start
                cols = shape.keys.stop - shape.keys.start
                work[rank][step] = rows * cols // (2 if shape.causal else 1)
    assert all(row == work[0] for row in work), work


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (run the GPU "
                    "check: README, GPU check)")
def test_cuda_kernel_blocks_merge_to_whole_attention() -> None:
    """The CUDA kernel pair the ring uses, over two key blocks in one process: the merged
    output and the gradients from the merged lse equal whole attention."""
    from sharding.ring_kernels import CudaEfficient, attend, merge

    q, k, v, grad, _ = (t.cuda() if t is not None else None
                        for t in _inputs(64, 4, 4, packed=False))
    scale = q.shape[-1] ** -0.5
    out_acc = torch.zeros_like(q)
    lse_acc = torch.full(q.shape[:3], float("-inf"), device="cuda")
    for keys in (slice(0, 32), slice(32, 64)):
        out, lse = attend(CudaEfficient, q, k[:, :, keys], v[:, :, keys], None, False, scale)
        merge(out_acc, lse_acc, out, lse, slice(0, 64))
    _close(out_acc, F.scaled_dot_product_attention(q, k, v))
    dq = sum(CudaEfficient.backward(grad, q, k[:, :, s], v[:, :, s], out_acc, lse_acc, False,
                                    None, scale)[0] for s in (slice(0, 32), slice(32, 64)))
    leaf = q.clone().requires_grad_()
    F.scaled_dot_product_attention(leaf, k, v).backward(grad)
    _close(dq, leaf.grad)


def test_the_ring_holds_one_query_heads_temporaries() -> None:
    """On meta (the memory model's own trace of the ring), 4 query heads on 1 KV head, bf16:
    forward holds the per-head fp32 output sums (2 q), the K/V block attended and the one
    arriving (1/2 q each) and one head's output; backward the per-head fp32 dq sums (2 q), the
    fp32 dK/dV block and the one arriving (1 q each), two K/V blocks and one head's gradients.
    Repeated K/V, whole-q fp32 merge temporaries or all heads' gradients at once (the ring
    before: 10 q and 15 q) would each break these bounds."""
    from checkpointing.planner.metatrace import LiveBytes
    from sharding.ring import MetaRingExchange

    q, k, v = (torch.empty(1, heads, 1024, 64, device="meta", dtype=torch.bfloat16,
                           requires_grad=True) for heads in (4, 1, 1))
    grad = torch.empty_like(q)
    with LiveBytes() as live:
        out = ring_attention(q, k, v, MetaRingExchange(4))
        forward = live.peak
        live.reset_peak()
        out.backward(grad)
        backward = live.peak
    assert forward <= 3.5 * q.nbytes and backward <= 6.25 * q.nbytes, (forward / q.nbytes,
                                                                      backward / q.nbytes)
