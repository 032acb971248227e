"""Ulysses sequence parallelism: N ranks share each sample, each holding 1/N of its tokens.

Everything outside attention is token-wise (norms, projections, MLP, residual), so a rank runs
it on its own contiguous chunk of the sequence. Attention needs every token: around it an
all-to-all trades the sequence split for a head split ([B, T/N, H] -> [B, T, H/N]), attention runs
on whole sequences for 1/N of the heads, and a second all-to-all trades back. Every rank computes
all positions of its heads, so causal attention is balanced across the group without reordering
tokens (ring attention needs that; Ulysses does not).

What lives here, all taking tensors and a process group or an exchange (no config):
  kv_repeats / check_degree     pure checks (sharding/degrees.py, torch-free, re-exported here)
  GroupExchange / MetaExchange  the all-to-all itself: the collective, or the meta trace's
                                stand-in (allocations of the same shapes, bytes sent counted)
  all_to_all                    differentiable re-split of one tensor (backward: the inverse one)
  sequence_to_heads / heads_to_sequence   the two directions, named
  ulysses_attention             wraps any attention function with SDPA's calling shape
  gather_sequence               whole-sequence metadata (positions, document ids) for the mask
  sequence_slice                this rank's chunk of a whole-sequence tensor
  build_sequence_mesh           the device mesh with a "sequence" axis, as the Layout places it

The collectives are torch's functional ones: differentiable, traceable by torch.compile, and
served by both gloo (CPU) and NCCL.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
from torch.distributed.device_mesh import DeviceMesh

from sharding.degrees import check_degree, kv_repeats  # re-exported
from sharding.fsdp import build_mesh
from sharding.layout import Layout

# Axis positions of (sequence, heads) in the two layouts attention code uses.
LAYOUTS = {"bhsd": (2, 1),   # scaled_dot_product_attention: [batch, heads, seq, head_dim]
           "bshd": (1, 2)}   # projections and HF attention outputs: [batch, seq, heads, head_dim]


# --- the exchange: the real all-to-all, or the meta trace's stand-in ----------------------

class GroupExchange:
    """all_to_all_single over a process group: dim 0 of what is sent holds one equal chunk per
    rank; chunk i of what arrives came from rank i. Torch's functional collective:
    differentiable (its gradient is the same exchange), traceable by torch.compile."""

    def __init__(self, group: dist.ProcessGroup) -> None:
        self.group = group
        self.size = dist.get_world_size(group)

    def __call__(self, send: torch.Tensor) -> torch.Tensor:
        return funcol.all_to_all_single(send, None, None, self.group)


class _MetaAllToAll(torch.autograd.Function):
    """all_to_all_single's shape (same size out as in), as an allocation: for meta tensors."""

    @staticmethod
    def forward(ctx, send: torch.Tensor) -> torch.Tensor:
        return send.new_empty(send.shape)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> torch.Tensor:
        return grad.new_empty(grad.shape)


class MetaExchange:
    """One rank's view of a group of `size` ranks on the meta device, without a process group:
    what arrives is an allocation of the received shape, so the memory model's trace sees the
    real layout's buffers byte for byte. Counts the bytes this rank sends (`sent_bytes`, summed
    over calls; its own chunk stays), for the step-time estimate."""

    def __init__(self, size: int) -> None:
        if size < 2:
            raise ValueError(f"a meta exchange needs a group of >= 2 ranks, got {size}")
        self.size = size
        self.sent_bytes = 0

    def __call__(self, send: torch.Tensor) -> torch.Tensor:
        self.sent_bytes += send.nbytes * (self.size - 1) // self.size
        return _MetaAllToAll.apply(send)


Exchange = Callable[[torch.Tensor], torch.Tensor]  # with .size: GroupExchange or MetaExchange


def as_exchange(group_or_exchange) -> Exchange:
    """A process group's GroupExchange; an exchange as it is."""
    if isinstance(group_or_exchange, (GroupExchange, MetaExchange)):
        return group_or_exchange
    return GroupExchange(group_or_exchange)


# --- the all-to-all -----------------------------------------------------------------------

def all_to_all(x: torch.Tensor, group, scatter_dim: int, gather_dim: int) -> torch.Tensor:
    """Split `scatter_dim` into N equal chunks, send chunk j to rank j of `group` (a process
    group or an exchange), and join the chunks received along `gather_dim` in rank order.

    With scatter=heads, gather=sequence, rank r goes from [B, T/N (chunk r), H] to
    [B, T, H/N (chunk r)]; swapping the two dims goes back. Differentiable: the gradient of this
    is the all-to-all with the two dims swapped, the exact inverse.
    """
    exchange = as_exchange(group)
    n = exchange.size
    scatter_dim, gather_dim = scatter_dim % x.dim(), gather_dim % x.dim()
    if scatter_dim == gather_dim:
        raise ValueError("all_to_all needs two different dims")
    if x.shape[scatter_dim] % n:
        raise ValueError(f"dim {scatter_dim} of size {x.shape[scatter_dim]} does not split "
                         f"into {n} equal chunks")
    if n == 1:
        return x
    return _exchange(_rank_major(x, n, scatter_dim).contiguous(), exchange, gather_dim)


def _rank_major(x: torch.Tensor, n: int, scatter_dim: int) -> torch.Tensor:
    """A view with the chunk for rank j at [j]: all_to_all_single splits dim 0 equally."""
    return x.unflatten(scatter_dim, (n, -1)).movedim(scatter_dim, 0)


def _exchange(send: torch.Tensor, exchange: Exchange, gather_dim: int) -> torch.Tensor:
    received = exchange(send)
    # received[i] came from rank i, which held chunk i of the gathered dim.
    return received.movedim(0, gather_dim).flatten(gather_dim, gather_dim + 1)


def sequence_to_heads(x: torch.Tensor, group, seq_dim: int = 1,
                      heads_dim: int = 2) -> torch.Tensor:
    """[B, T/N, H, D] (this rank's tokens, all heads) -> [B, T, H/N, D] (all tokens, its heads)."""
    return all_to_all(x, group, scatter_dim=heads_dim, gather_dim=seq_dim)


def heads_to_sequence(x: torch.Tensor, group, seq_dim: int = 1,
                      heads_dim: int = 2) -> torch.Tensor:
    """[B, T, H/N, D] -> [B, T/N, H, D]: the inverse of sequence_to_heads."""
    return all_to_all(x, group, scatter_dim=seq_dim, gather_dim=heads_dim)


# --- attention ----------------------------------------------------------------------------

def ulysses_attention(attention_fn: Callable[..., torch.Tensor], q: torch.Tensor,
                      k: torch.Tensor, v: torch.Tensor, group, *args,
                      layout: str = "bhsd", out_layout: Optional[str] = None,
                      **kwargs) -> torch.Tensor:
    """`attention_fn(q, k, v, *args, **kwargs)` over whole sequences, from sequence shards.

    q, k, v hold this rank's contiguous chunk of the sequence and all heads, in `layout`
    ("bhsd" as scaled_dot_product_attention takes them, or "bshd"); the result is this rank's
    chunk of the attention output in `out_layout` (default: `layout`; HF attention functions
    return "bshd" from "bhsd" inputs). `attention_fn` sees whole sequences and heads/N query
    heads, so is_causal, a document mask for the whole sequence (see gather_sequence) and
    enable_gqa pass through `kwargs` unchanged. A mask must broadcast over heads (size 1 there):
    the rank's heads are a slice this function does not apply to masks.

    `group`: a process group (the real all-to-all) or an exchange (GroupExchange, or the meta
    trace's MetaExchange: the same layout, allocations instead of the collective).
    KV heads are repeated where kv_repeats says; its docstring lists what is supported.
    """
    exchange = as_exchange(group)
    n = exchange.size
    seq_dim, heads_dim = _axes(layout)
    if n > 1:
        repeats = kv_repeats(q.shape[heads_dim], k.shape[heads_dim], n)
        if repeats > 1:
            k, v = (t.repeat_interleave(repeats, dim=heads_dim) for t in (k, v))
        q, k, v = _qkv_to_heads(q, k, v, exchange, seq_dim, heads_dim)
    out = attention_fn(q, k, v, *args, **kwargs)
    out_seq, out_heads = _axes(out_layout or layout)
    return heads_to_sequence(out, exchange, seq_dim=out_seq, heads_dim=out_heads)


def _axes(layout: str) -> tuple[int, int]:
    if layout not in LAYOUTS:
        raise ValueError(f"layout {layout!r}: use one of {sorted(LAYOUTS)}")
    return LAYOUTS[layout]


def _qkv_to_heads(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, exchange: Exchange,
                  seq_dim: int, heads_dim: int) -> tuple[torch.Tensor, ...]:
    """One all-to-all for q, k and v where they can travel together (same dtype and head size),
    three otherwise: a collective's latency is paid once, not three times."""
    tensors = (q, k, v)
    if len({(t.dtype, t.shape[-1]) for t in tensors}) > 1:
        return tuple(sequence_to_heads(t, exchange, seq_dim, heads_dim) for t in tensors)
    n = exchange.size
    # Rank j receives [q chunk j, k chunk j, v chunk j]: one cat makes the send buffer.
    send = torch.cat([_rank_major(t, n, heads_dim) for t in tensors], dim=heads_dim + 1)
    local = _exchange(send, exchange, seq_dim)
    return tuple(local.split([t.shape[heads_dim] // n for t in tensors], dim=heads_dim))


# --- whole-sequence metadata and this rank's slice ----------------------------------------

def gather_sequence(x: torch.Tensor, group: dist.ProcessGroup, dim: int = 1) -> torch.Tensor:
    """The whole sequence of a sequence-sharded tensor, on every rank of `group` (chunks in rank
    order along `dim`). For metadata such as positions or document ids, from which each rank
    builds the whole-sequence document mask; no gradient flows through it."""
    if x.requires_grad:
        raise ValueError("gather_sequence is for metadata (positions, document ids); it does "
                         "not carry gradients")
    if dist.get_world_size(group) == 1:
        return x
    dim = dim % x.dim()
    # The functional all-gather joins along dim 0 only.
    gathered = funcol.all_gather_single(x.movedim(dim, 0).contiguous(), 0, group)
    return funcol.wait_tensor(gathered).movedim(0, dim)


def sequence_slice(x: torch.Tensor, rank: int, degree: int, dim: int = 1) -> torch.Tensor:
    """Contiguous chunk `rank` of `degree` equal chunks of `dim` (a view): the tokens, targets or
    positions a rank of a sequence group holds. rank: the rank within the sequence group."""
    check_degree(x.shape[dim], degree)
    if not 0 <= rank < degree:
        raise ValueError(f"rank {rank} is not in a sequence group of {degree}")
    chunk = x.shape[dim] // degree
    return x.narrow(dim, rank * chunk, chunk)


# --- the device mesh ----------------------------------------------------------------------

@dataclass(frozen=True)
class SequenceMesh:
    """Where a rank stands when N x M ranks share each sample (the layout's sample groups).

    Ranks r*NM .. r*NM+NM-1 share sample share r (Layout.data_rank): M rings places
    (sharding.context) of N adjacent Ulysses ranks each; FSDP shards parameters over every rank
    of a replica, sequence and ring ranks included, so `fsdp` is sharding.fsdp.build_mesh's:
    1-D ("shard",) for fsdp, 2-D ("replicate", "shard") for hsdp.
    """

    mesh: DeviceMesh            # ("data", ["context",] "sequence"), "replicate" first (hsdp)
    fsdp: DeviceMesh            # what fully_shard gets
    group: dist.ProcessGroup    # this rank's sequence (Ulysses) group
    rank: int                   # this rank's place in its sequence group (its slice)
    context_group: Optional[dist.ProcessGroup] = None  # its ring (None: context 1)
    context_rank: int = 0       # its place in the ring (its balanced pair of chunks)


def build_sequence_mesh(layout: Layout, device_type: str) -> SequenceMesh:
    """The mesh of sharding.fsdp.build_mesh, its "shard" axis split into ("data", "context",
    "sequence") with the sequence ranks adjacent (they talk every block: keep them on one
    node) and the ring outside them, as the layout places them. Needs a process group."""
    fsdp = build_mesh(layout, device_type)
    degree, context = layout.degree, layout.context
    if context == 1:
        mesh = fsdp._unflatten("shard", (layout.shard // degree, degree), ("data", "sequence"))
    else:
        mesh = fsdp._unflatten("shard", (layout.shard // (degree * context), context, degree),
                               ("data", "context", "sequence"))
    group = mesh.get_group("sequence")
    ring = mesh.get_group("context") if context > 1 else None
    seq = SequenceMesh(mesh=mesh, fsdp=fsdp, group=group, rank=dist.get_rank(group),
                       context_group=ring,
                       context_rank=dist.get_rank(ring) if ring is not None else 0)
    # The Data gives rank r slice layout.sequence_rank(r) of its ring place
    # layout.context_rank(r) of its group's samples: the mesh must place it there.
    me = dist.get_rank()
    if (seq.rank, seq.context_rank) != (layout.sequence_rank(me), layout.context_rank(me)):
        raise AssertionError(f"the sequence mesh puts rank {me} at {seq.rank, seq.context_rank}"
                             f", the layout at {layout.sequence_rank(me), layout.context_rank(me)}")
    return seq
