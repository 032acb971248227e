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
log-sum-exp; CUDA's flash / efficient kernels), the point-to-point collectives. Ours: the loop,
the merge and the backward. torch's own context parallelism (`torch.distributed.tensor.
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

NEG_INF = float("-inf")


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


# --- the kernels ------------------------------------------------------------------------

class CpuFlash:
    """The CPU flash kernel: returns the log-sum-exp the merge needs; takes an additive mask of
    the query's dtype. A row whose keys are all masked comes back with lse 0 and a zero output
    (not -inf): `_attend` marks such rows itself."""

    @staticmethod
    def forward(q, k, v, causal: bool, mask: Optional[torch.Tensor], scale: float):
        return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
            q, k, v, 0.0, causal, attn_mask=mask, scale=scale)

    @staticmethod
    def backward(grad_out, q, k, v, out, lse, causal: bool, mask: Optional[torch.Tensor],
                 scale: float):
        return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
            grad_out, q, k, v, out, lse, 0.0, causal, attn_mask=mask, scale=scale)


class CudaEfficient:
    """CUDA's memory-efficient kernel: takes an additive mask (packed rows) and returns the
    log-sum-exp. Not run here (no GPU); tests/test_ring.py has its CUDA-marked check."""

    @staticmethod
    def forward(q, k, v, causal: bool, mask: Optional[torch.Tensor], scale: float):
        out, lse, *_ = torch.ops.aten._scaled_dot_product_efficient_attention(
            q, k, v, mask, True, 0.0, causal, scale=scale)
        return out, lse[..., :q.shape[2]]   # lse is padded to a multiple of 32 rows

    @staticmethod
    def backward(grad_out, q, k, v, out, lse, causal: bool, mask: Optional[torch.Tensor],
                 scale: float):
        seed = offset = torch.zeros((), dtype=torch.int64, device=q.device)
        # The kernel reads lse in its forward's padded shape (rows rounded up to 32).
        pad = -q.shape[2] % 32
        lse = torch.nn.functional.pad(lse, (0, pad)).contiguous()
        dq, dk, dv, _ = torch.ops.aten._scaled_dot_product_efficient_attention_backward(
            grad_out, q, k, v, mask, out, lse, seed, offset, 0.0,
            (True, True, True, False), causal, scale=scale)
        return dq, dk, dv


def kernel_for(device: torch.device):
    """CUDA's kernel on CUDA, and on meta (the memory model's trace, which predicts a GPU run:
    its shapes, and FLOPs torch's counter knows, which it does not for the CPU kernel)."""
    return CudaEfficient if device.type in ("cuda", "meta") else CpuFlash


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


# --- attention over one block, and the merge --------------------------------------------

def _attend(kernel, q, k, v, mask, causal, scale):
    """(out, lse) of q against one key block; rows with no visible key get lse -inf."""
    groups = q.shape[1] // k.shape[1]
    if groups > 1:  # the kernels take equal head counts; the ring carries the KV heads only
        k, v = (t.repeat_interleave(groups, dim=1) for t in (k, v))
    out, lse = kernel.forward(q, k, v, causal, mask, scale)
    if mask is not None:
        seen = (mask == 0).any(dim=-1)                    # [B, 1, Tq]
        lse = lse.masked_fill(~seen, NEG_INF)
    return out, lse


def _merge(out_acc, lse_acc, out, lse, rows: slice) -> None:
    """Fold a block's (out, lse) into the running fp32 result, in place, for `rows`: the
    softmax over the union of keys. The running lse is finite (step 0 sees each row's own
    key), so a block's -inf rows weigh exactly 0."""
    acc, acc_lse = out_acc[:, :, rows], lse_acc[:, :, rows]
    new = torch.logaddexp(acc_lse, lse.float())
    out_acc[:, :, rows] = (acc * (acc_lse - new).exp()[..., None]
                           + out.float() * (lse.float() - new).exp()[..., None])
    lse_acc[:, :, rows] = new


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
    @staticmethod
    def forward(ctx, q, k, v, exchange, layout: _Layout, scale: float):
        kernel = kernel_for(q.device)
        out_acc = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
        lse_acc = torch.full(q.shape[:3], NEG_INF, dtype=torch.float32, device=q.device)
        buffer = _pack(k, v)
        for step in range(exchange.size):
            pending = exchange.start(buffer) if step < exchange.size - 1 else None
            source, shape = layout.shape(step)
            if shape is not None:
                kk, vv = _unpack(buffer, k, v)
                mask, causal = _block_mask(layout, source, shape, q.dtype)
                out, lse = _attend(kernel, q[:, :, shape.queries], kk[:, :, shape.keys],
                                   vv[:, :, shape.keys], mask, causal, scale)
                _merge(out_acc, lse_acc, out, lse, shape.queries)
            if pending is not None:
                buffer = pending()
        out = out_acc.to(q.dtype)
        ctx.save_for_backward(q, k, v, out, lse_acc)
        ctx.exchange, ctx.layout, ctx.scale = exchange, layout, scale
        return out

    @staticmethod
    def backward(ctx, grad_out):
        q, k, v, out, lse = ctx.saved_tensors
        exchange, layout, scale = ctx.exchange, ctx.layout, ctx.scale
        kernel = kernel_for(q.device)
        grad_out = grad_out.contiguous()
        dq = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
        dk, dv = (torch.zeros(t.shape, dtype=torch.float32, device=t.device) for t in (k, v))
        kv, grads = _pack(k, v), _pack(dk, dv)
        for step in range(exchange.size):
            pending = exchange.start(kv) if step < exchange.size - 1 else None
            source, shape = layout.shape(step)
            if shape is not None:
                kk, vv = _unpack(kv, k, v)
                gk, gv = _unpack(grads, dk, dv)
                mask, causal = _block_mask(layout, source, shape, q.dtype)
                parts = _attend_backward(kernel, grad_out, q, kk, vv, out, lse, shape, mask,
                                         causal, scale)
                dq[:, :, shape.queries] += parts[0]
                gk[:, :, shape.keys] += parts[1]
                gv[:, :, shape.keys] += parts[2]
            # The gradients travel with their block and reach its owner after the last step.
            grads = exchange.start(grads)()
            if pending is not None:
                kv = pending()
        dk, dv = _unpack(grads, dk, dv)
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), None, None, None


def _attend_backward(kernel, grad_out, q, k, v, out, lse, shape: Step, mask, causal, scale):
    """(dq, dk, dv) of one block, from the merged output and lse (the block's probabilities
    are exp(scores - merged lse): exact shares of the whole softmax)."""
    rows = shape.queries
    kk, vv = k[:, :, shape.keys], v[:, :, shape.keys]
    groups = q.shape[1] // k.shape[1]
    if groups > 1:
        kk, vv = (t.repeat_interleave(groups, dim=1) for t in (kk, vv))
    dq, dk, dv = kernel.backward(grad_out[:, :, rows].contiguous(), q[:, :, rows].contiguous(),
                                 kk.contiguous(), vv.contiguous(),
                                 out[:, :, rows].contiguous(), lse[:, :, rows].contiguous(),
                                 causal, mask, scale)
    if groups > 1:  # the repeated heads' gradients sum into their KV head
        dk, dv = (t.unflatten(1, (-1, groups)).sum(2) for t in (dk, dv))
    return dq.float(), dk.float(), dv.float()


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
