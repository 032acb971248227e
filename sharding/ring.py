"""Ring attention (context parallelism): M ranks share a sample past the head count.

Ulysses (sharding/sequence.py) trades tokens for heads, so a sample can be shared by at most as
many ranks as there are heads. The ring keeps each rank's queries where they are and passes the
key/value blocks around: at step i rank r attends with its queries to the keys of rank r - i, and
the partial results (an output and its log-sum-exp per query row) are merged exactly as a softmax
over the union of keys would be. After M steps every query has seen every key; nothing of size
heads limits M.

Causal balance. With contiguous chunks the last rank would attend to every key and the first to
its own only. Each rank instead holds two of 2M equal chunks, r and 2M-1-r (an early and a late
one: `balanced_slice`), so every rank does the same work. With that layout each step is one of
three shapes and needs no mask at all:
  step 0 (its own keys)          queries x keys, causal on the local order (the two chunks are
                                 in position order, so local causality is global causality)
  source s < r (earlier ranks)   all queries x the source's early chunk, no mask
  source s > r (later ranks)     the late query chunk x all the source's keys, no mask
Packed rows (documents) add a mask from the document ids and positions of both sides.

Which parts are torch's: the attention kernels (the CPU flash kernel here, which returns the
log-sum-exp; CUDA's efficient kernel; called one query head at a time with the merge in place:
sharding/ring_kernels.py), the point-to-point collectives. Ours: the loop, the merge and the
backward. torch's own context parallelism (`torch.distributed.tensor.
experimental.context_parallel`) runs the same algorithm but only through DTensor dispatch of the
CUDA SDPA ops with one mask for every step, a module-level options object, and private helpers
whose signatures change between releases; it cannot take per-step document masks or the CPU
kernel. The loop below is the smallest piece that can.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
import torch.distributed as dist

from sharding.ring_kernels import (NEG_INF, attend_heads, attend_heads_backward,
                                   heads_joined, kernel_for, per_head_zeros)


# --- the layout -------------------------------------------------------------------------

def balanced_slice(x: torch.Tensor, rank: int, size: int, dim: int = 1) -> torch.Tensor:
    """Chunks `rank` and `2*size-1-rank` of 2*size equal chunks of `dim`, joined in that order:
    the tokens (or targets, positions, document ids) rank `rank` of a ring of `size` holds."""
    if x.shape[dim] % (2 * size):
        raise ValueError(f"a length of {x.shape[dim]} does not split into {2 * size} equal "
                         f"chunks (2 x the ring of {size})")
    chunks = x.chunk(2 * size, dim=dim)
    return torch.cat([chunks[rank], chunks[2 * size - 1 - rank]], dim=dim)


def balanced_unslice(parts: list[torch.Tensor], dim: int = 1) -> torch.Tensor:
    """The whole sequence from every rank's balanced slice (rank order): the inverse."""
    size = len(parts)
    chunks: list[Optional[torch.Tensor]] = [None] * (2 * size)
    for rank, part in enumerate(parts):
        early, late = part.chunk(2, dim=dim)
        chunks[rank], chunks[2 * size - 1 - rank] = early, late
    return torch.cat(chunks, dim=dim)


def balanced_positions(length: int, rank: int, size: int,
                       device: torch.device | str = "cpu") -> torch.Tensor:
    """The global positions [length / size] of the tokens rank `rank` holds."""
    return balanced_slice(torch.arange(length, device=device)[None], rank, size)[0]


def sample_slice(x: torch.Tensor, context_rank: int, context: int, sequence_rank: int,
                 sequence: int, dim: int = 1) -> torch.Tensor:
    """What a rank holds of a whole-sample tensor (tokens, targets, positions) when sequence x
    context ranks share the sample (sharding/layout.py): its ring place's balanced pair of
    chunks, and within that its Ulysses slice (contiguous: the all-to-all rebuilds the pair)."""
    from sharding.sequence import sequence_slice

    if context > 1:
        x = balanced_slice(x, context_rank, context, dim)
    return sequence_slice(x, sequence_rank, sequence, dim)


def sample_positions(length: int, context_rank: int, context: int, sequence_rank: int,
                     sequence: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """The global positions [length / (sequence x context)] of the tokens a rank holds."""
    whole = torch.arange(length, device=device)[None]
    return sample_slice(whole, context_rank, context, sequence_rank, sequence)[0]


def gather_ring(x: torch.Tensor, group: Optional[dist.ProcessGroup],
                dim: int = 1) -> torch.Tensor:
    """The whole sample, in position order, from each ring rank's balanced slice of it (for
    metadata: positions, document ids; no gradient). group None: `x` itself."""
    if group is None or dist.get_world_size(group) == 1:
        return x
    parts = [torch.empty_like(x) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, x.contiguous(), group=group)
    return balanced_unslice(parts, dim=dim)


# --- one step's shape -------------------------------------------------------------------

@dataclass(frozen=True)
class Step:
    """Which queries meet which keys at one ring step, and how they are masked."""

    queries: slice          # of the local queries (all, or the late chunk)
    keys: slice             # of the source's keys (all, or the early chunk)
    causal: bool            # the local diagonal


def step_shape(rank: int, source: int, local_len: int, causal: bool) -> Optional[Step]:
    """The step's shape under the balanced layout (see the module docstring); None: skip."""
    everything, half = slice(0, local_len), local_len // 2
    if not causal:
        return Step(everything, everything, False)
    if source == rank:
        return Step(everything, everything, True)
    if source < rank:
        return Step(everything, slice(0, half), False)
    return Step(slice(half, local_len), everything, False)


def document_mask(q_pos, k_pos, q_doc, k_doc, dtype) -> torch.Tensor:
    """Additive mask [B, 1, Tq, Tk]: a query sees the keys at or before it in its document."""
    allowed = (k_pos[None, None, :] <= q_pos[None, :, None]) & (q_doc[:, :, None] ==
                                                               k_doc[:, None, :])
    mask = torch.zeros(allowed.shape, dtype=dtype, device=q_doc.device)
    return mask.masked_fill_(~allowed, NEG_INF)[:, None]


# --- the exchange -----------------------------------------------------------------------

class RingExchange:
    """Sends a buffer to the next rank of the ring and receives the previous rank's, started
    before the step that uses the current buffer computes (the next block travels meanwhile)."""

    def __init__(self, group: dist.ProcessGroup) -> None:
        self.group = group
        self.rank, self.size = dist.get_rank(group), dist.get_world_size(group)
        self._next = dist.get_global_rank(group, (self.rank + 1) % self.size)
        self._prev = dist.get_global_rank(group, (self.rank - 1) % self.size)

    def start(self, send: torch.Tensor):
        """Start the exchange; returns a function that waits and gives the received buffer."""
        received = torch.empty_like(send)
        requests = dist.batch_isend_irecv([
            dist.P2POp(dist.isend, send, self._next, self.group),
            dist.P2POp(dist.irecv, received, self._prev, self.group)])

        def wait() -> torch.Tensor:
            for request in requests:
                request.wait()
            return received
        return wait

    def gather(self, x: torch.Tensor) -> list[torch.Tensor]:
        """Every rank's `x` (metadata: document ids), in ring order."""
        parts = [torch.empty_like(x) for _ in range(self.size)]
        dist.all_gather(parts, x.contiguous(), group=self.group)
        return parts


class MetaRingExchange:
    """One rank's view of a ring of `size` on the meta device, without a process group: what
    arrives is an allocation of the sent shape, so the memory model's trace runs the ring's
    own code and sees its buffers byte for byte (the key/value block in flight beside the one
    attended: double-buffered; the travelling dK/dV in backward). Counts the bytes this rank
    sends to its neighbour (`sent_bytes`; forward K/V, backward K/V and their gradients)."""

    def __init__(self, size: int, rank: int = 0) -> None:
        if size < 2:
            raise ValueError(f"a meta ring needs >= 2 ranks, got {size}")
        self.size, self.rank, self.sent_bytes = size, rank, 0

    def start(self, send: torch.Tensor):
        self.sent_bytes += send.nbytes
        received = torch.empty_like(send)
        return lambda: received

    def gather(self, x: torch.Tensor) -> list[torch.Tensor]:
        return [torch.empty_like(x) for _ in range(self.size)]


# --- the masks of one step -----------------------------------------------------------

def _block_mask(layout: "_Layout", source: int, shape: Step, dtype):
    if layout.docs is None:
        return None, shape.causal
    q_pos = layout.positions(layout.rank)[shape.queries]
    k_pos = layout.positions(source)[shape.keys]
    q_doc = layout.docs[layout.rank][:, shape.queries]
    k_doc = layout.docs[source][:, shape.keys]
    return document_mask(q_pos, k_pos, q_doc, k_doc, dtype), False  # causality is in the mask


@dataclass
class _Layout:
    rank: int
    size: int
    local_len: int
    causal: bool
    docs: Optional[list[torch.Tensor]]   # every rank's document ids [B, T_local], or None
    device: torch.device

    def positions(self, rank: int) -> torch.Tensor:
        return balanced_positions(self.local_len * self.size, rank, self.size, self.device)

    def shape(self, step: int) -> tuple[int, Optional[Step]]:
        source = (self.rank - step) % self.size
        return source, step_shape(self.rank, source, self.local_len, self.causal)


# --- the differentiable ring ------------------------------------------------------------

def _pack(*tensors: torch.Tensor) -> torch.Tensor:
    return torch.cat([t.reshape(-1) for t in tensors])


def _unpack(buffer: torch.Tensor, *like: torch.Tensor) -> list[torch.Tensor]:
    sizes = [t.numel() for t in like]
    return [part.view(t.shape) for part, t in zip(buffer.split(sizes), like)]


class _RingAttention(torch.autograd.Function):
    """The ring's forward and backward (sharding/ring_kernels.py: one query head per kernel
    call, per-head fp32 accumulators, the merge in place). Two K/V blocks live at a time (the
    one attended, the one arriving), and in backward two fp32 dK/dV blocks (travelling)."""

    @staticmethod
    def forward(ctx, q, k, v, exchange, layout: _Layout, scale: float):
        kernel = kernel_for(q.device)
        out_acc = per_head_zeros(q)
        lse_acc = torch.full(q.shape[:3], NEG_INF, dtype=torch.float32, device=q.device)
        buffer = _pack(k, v)
        for step in range(exchange.size):
            pending = exchange.start(buffer) if step < exchange.size - 1 else None
            source, shape = layout.shape(step)
            if shape is not None:
                kk, vv = _unpack(buffer, k, v)
                mask, causal = _block_mask(layout, source, shape, q.dtype)
                attend_heads(kernel, q, kk, vv, out_acc, lse_acc, shape.queries, shape.keys,
                             mask, causal, scale)
                del kk, vv, mask
            # The block just attended is dropped here (its send has completed), not later.
            buffer = pending() if pending is not None else None
        out = heads_joined(out_acc, q)
        ctx.save_for_backward(q, k, v, out, lse_acc)
        ctx.exchange, ctx.layout, ctx.scale = exchange, layout, scale
        return out

    @staticmethod
    def backward(ctx, grad_out):
        q, k, v, out, lse = ctx.saved_tensors
        exchange, layout, scale = ctx.exchange, ctx.layout, ctx.scale
        kernel = kernel_for(q.device)
        dq_acc = per_head_zeros(q)
        # dK and dV of the visiting block, packed to travel as one message.
        grads = torch.zeros(k.numel() + v.numel(), dtype=torch.float32, device=k.device)
        kv = _pack(k, v)
        for step in range(exchange.size):
            pending = exchange.start(kv) if step < exchange.size - 1 else None
            source, shape = layout.shape(step)
            if shape is not None:
                kk, vv = _unpack(kv, k, v)
                gk, gv = _unpack(grads, k, v)
                mask, causal = _block_mask(layout, source, shape, q.dtype)
                attend_heads_backward(kernel, grad_out, q, kk, vv, out, lse, dq_acc, gk, gv,
                                      shape.queries, shape.keys, mask, causal, scale)
                del kk, vv, gk, gv, mask
            # The gradients travel with their block and reach its owner after the last step.
            grads = exchange.start(grads)()
            kv = pending() if pending is not None else None
        dk, dv = (t.to(k.dtype) for t in _unpack(grads, k, v))
        del grads
        return heads_joined(dq_acc, q), dk, dv, None, None, None


def ring_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, group: dist.ProcessGroup,
                   *, causal: bool = True, scale: Optional[float] = None,
                   documents: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Attention over the whole sample from this rank's balanced slice of it.

    q [B, H, T/M, D], k and v [B, KV heads, T/M, D]: this rank's tokens (`balanced_slice`) of a
    ring of M = the group's size; returns its tokens' output [B, H, T/M, D]. `documents`
    [B, T/M]: the tokens' document ids for packed rows (attention stays in a document; ids must
    be the same across the ring for the same document). `group`: a process group, or an
    exchange (RingExchange, or the meta trace's MetaRingExchange)."""
    exchange = (group if isinstance(group, (RingExchange, MetaRingExchange))
                else RingExchange(group))
    docs = exchange.gather(documents) if documents is not None else None
    if causal and q.shape[2] % 2:
        raise ValueError(f"a balanced ring slice holds two equal chunks; {q.shape[2]} tokens "
                         "do not split in two")
    layout = _Layout(exchange.rank, exchange.size, q.shape[2], causal, docs, q.device)
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    return _RingAttention.apply(q, k, v, exchange, layout, scale)
