"""Ulysses on the meta device: what one rank of a sequence group holds, without a process group.

The meta trace (metatrace.py) measures one rank. With sequence degree N that rank runs its T/N
tokens through every token-wise part of the block, and attention on all T tokens for H/N heads
between two all-to-alls (sharding/sequence.py). `MetaUlysses.wrap` stands in for
`sharding.sequence.ulysses_attention` around a family's attention hook: the same repeat of KV
heads, the same concatenated send buffer and the same re-layout of what arrives, only the
exchange itself is an allocation of the received shape (`new_empty`) instead of a collective. So
the saved storages and the transients are the real layout's, byte for byte, and the tracer's
live-bytes count sees the buffers the all-to-alls hold.

It also counts the bytes a rank sends per forward (`sent_bytes`), for the step-time estimate.
"""

from __future__ import annotations

from typing import Callable

import torch

from sharding.sequence import kv_repeats

Attend = Callable[..., torch.Tensor]
SEQ, HEADS = 2, 1  # [batch, heads, seq, head_dim], as attention hooks take q, k and v


class _Exchange(torch.autograd.Function):
    """all_to_all_single's shape (dim 0 holds the N chunks, same size out as in), on meta."""

    @staticmethod
    def forward(ctx, send: torch.Tensor) -> torch.Tensor:
        return send.new_empty(send.shape)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> torch.Tensor:
        return grad.new_empty(grad.shape)


class MetaUlysses:
    """One rank's view of Ulysses attention over a group of `degree` ranks."""

    def __init__(self, degree: int) -> None:
        if degree < 2:
            raise ValueError(f"MetaUlysses needs a degree >= 2, got {degree}")
        self.degree = degree
        self.sent_bytes = 0  # bytes this rank sent to the others, summed over forward calls

    def _exchange(self, send: torch.Tensor, gather_dim: int) -> torch.Tensor:
        # What stays on this rank (its own chunk) is not sent.
        self.sent_bytes += send.nbytes * (self.degree - 1) // self.degree
        received = _Exchange.apply(send)
        return received.movedim(0, gather_dim).flatten(gather_dim, gather_dim + 1)

    def _rank_major(self, x: torch.Tensor, dim: int) -> torch.Tensor:
        return x.unflatten(dim, (self.degree, -1)).movedim(dim, 0)

    def _to_heads(self, q: torch.Tensor, k: torch.Tensor,
                  v: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """[B, H, T/N, D] each -> [B, H/N, T, D] each, one exchange when they can share one."""
        tensors = (q, k, v)
        if len({(t.dtype, t.shape[-1]) for t in tensors}) > 1:
            return tuple(self._exchange(self._rank_major(t, HEADS).contiguous(), SEQ)
                         for t in tensors)
        send = torch.cat([self._rank_major(t, HEADS) for t in tensors], dim=HEADS + 1)
        local = self._exchange(send, SEQ)
        return tuple(local.split([t.shape[HEADS] // self.degree for t in tensors], dim=HEADS))

    def attention(self, attend: Attend, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                  **options) -> torch.Tensor:
        repeats = kv_repeats(q.shape[HEADS], k.shape[HEADS], self.degree)
        if repeats > 1:
            k, v = (t.repeat_interleave(repeats, dim=HEADS) for t in (k, v))
        # A mask made for the slice does not fit whole sequences; the real wrap passes the
        # whole-sequence one, whose bytes the block's inputs already hold. Here: causal.
        if "attention_mask" in options:  # HF's: None is causal over what attention sees
            options["attention_mask"] = None
        options.pop("position_ids", None)  # the slice's, as the real HF wrap drops them
        if options.get("mask") is not None:
            raise ValueError("the meta trace of sequence parallelism takes unpacked rows "
                             "(a document mask is built for the whole sequence at run time)")
        q, k, v = self._to_heads(q, k, v)
        out = attend(q, k, v, **options)
        # Attention hooks answer [B, H/N, T, D] (HF's too, trainer/models/hf.py's attend);
        # a raw HF attention function's [B, T, H/N, D] is taken as well.
        seq_dim, heads_dim = (SEQ, HEADS) if out.shape[SEQ] == q.shape[SEQ] else (1, 2)
        if (seq_dim, heads_dim) == (1, 2) and out.shape[1] != q.shape[SEQ]:
            raise ValueError(f"attention output {tuple(out.shape)} is in no layout known")
        return self._exchange(self._rank_major(out, seq_dim).contiguous(), heads_dim)

    def wrap(self, current: Attend) -> Attend:
        """For a family's `wrap_attention`: `current` runs on whole sequences, H/N heads."""
        def attend(q, k, v, **options):
            return self.attention(current, q, k, v, **options)
        return attend
