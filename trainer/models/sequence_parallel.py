"""Sequence parallelism inside the models: N ranks share one sample, each holding a contiguous
1/N of its tokens, and the model's forward on that slice is exactly the slice of the
whole-sequence forward (sharding/sequence.py holds the collectives).

What a model needs besides the Ulysses attention wrap (sharding.sequence.ulysses_attention):
  * the *global* positions of its tokens, so rotary angles are those of the whole sequence
    (rank r of N, unpacked rows: r*T/N + i; packed rows: the slice of the packed positions);
  * for packed rows, the document mask of the whole sequence, built from the positions gathered
    over the group: after the all-to-all, attention sees every token;
  * for unpacked rows, causal attention over the whole sequence (SDPA's is_causal on the
    gathered q, k, v).

Every token-wise part (norms, projections, MLP, residual dropout, the plain or chunked head on
the rank's slice of the targets) needs nothing. Attention dropout cannot match N=1: a rank
attends with other heads than it would alone, so it draws other dropout masks (the model is
still trained with the right dropout rate, only not with N=1's random numbers).

Ring attention (sharding.context=M, sharding/ring.py) composes with it: each ring place holds a
balanced early and late chunk of the sample (its Ulysses group splits that pair contiguously),
rotary angles come from the true positions of those chunks, Ulysses' all-to-all gathers the
ring place's tokens, and the ring replaces the attention kernel itself (`ring_wrap`, inside
Ulysses' wrap). Packed rows carry the ring place's document ids [B, T/M] to it instead of a
T x T mask (the ring masks each key block it meets).

The groups live on the model (`model.sequence_group`, `model.context_group`, set by the
family's `sequence_parallel`)
and everything per forward travels through the forward's own arguments (the block's mask, HF's
attention kwargs), so activation checkpointing recomputes it from the block's inputs.
"""

from __future__ import annotations

from typing import Callable, Optional

import torch
import torch.distributed as dist

from sharding.ring import balanced_slice, gather_ring, ring_attention, sample_positions
from sharding.sequence import Exchange, gather_sequence, ulysses_attention
from trainer.models.hf_settings import HF_IMPLEMENTATIONS  # re-exported: the torch-free list

Attend = Callable[..., torch.Tensor]
# (attention keyword arguments, query heads, KV heads, degree) -> the arguments under Ulysses
Options = Callable[[dict, int, int, int], dict]
# The HF attention kwarg carrying the whole-sequence mask (None: causal) to the wrapped attention;
# HF passes unknown keyword arguments of the model's forward down to its attention functions.
SEQUENCE_MASK = "blocktrain_sequence_mask"


def group_place(group: Optional[dist.ProcessGroup]) -> tuple[int, int]:
    """(this rank's place in the sequence group, the group's size); (0, 1) without a group."""
    if group is None:
        return 0, 1
    return dist.get_rank(group), dist.get_world_size(group)


def global_positions(tokens: torch.Tensor, group: Optional[dist.ProcessGroup]) -> torch.Tensor:
    """[B, T/N] positions r*T/N + i of an unpacked row's slice (rank r of N): its place in the
    whole sequence."""
    rank, _ = group_place(group)
    batch, local = tokens.shape
    start = rank * local
    return torch.arange(start, start + local, device=tokens.device).expand(batch, local)


def whole_positions(positions: torch.Tensor, group: Optional[dist.ProcessGroup]) -> torch.Tensor:
    """The whole sequence's positions from each rank's slice (all ranks get the same)."""
    return positions if group is None else gather_sequence(positions, group, dim=1)


def ulysses_wrap(exchange: Exchange, options: Optional[Options] = None
                 ) -> Callable[[Attend], Attend]:
    """A wrap for a family's `wrap_attention`: its attend(q, k, v, **options) ([B, heads, T/N,
    head_dim] in and out) runs over whole sequences through the exchange's all-to-alls (the
    real one, or the meta trace's: sharding/sequence.py). `options`: the family's change to
    its attention's keyword arguments (HF's: trainer/models/hf.py's ulysses_options); without
    it they pass through unchanged (the whole-sequence mask, dropout, enable_gqa)."""
    def wrap(current: Attend) -> Attend:
        def attend(q, k, v, **kwargs):
            if options is not None:
                kwargs = options(kwargs, q.shape[1], k.shape[1], exchange.size)
            return ulysses_attention(current, q, k, v, exchange, **kwargs)
        attend.exchanges_tokens = True  # query tiles must not slice its sequences
        return attend
    return wrap


def hf_whole_mask(positions: Optional[torch.Tensor], group: dist.ProcessGroup, seq_len: int,
                  implementation: str, dtype: torch.dtype,
                  device: torch.device) -> Optional[torch.Tensor]:
    """The mask HF's attention function `implementation` gets over the whole sequence: None
    (SDPA's is_causal) for unpacked sdpa rows; a boolean [B, 1, T, T] document mask for packed
    sdpa rows (`positions`: the slice's, gathered here); eager adds its mask to the scores, so
    it always gets an additive one (0 allowed, the dtype's minimum elsewhere)."""
    from trainer.models.doc_attention import document_mask

    if positions is not None:
        allowed = document_mask(whole_positions(positions, group), "sdpa")
    elif implementation == "eager":
        allowed = torch.ones(seq_len, seq_len, dtype=torch.bool, device=device).tril()
        allowed = allowed.view(1, 1, seq_len, seq_len)
    else:
        return None
    if implementation == "eager":
        return torch.zeros(allowed.shape, dtype=dtype, device=device).masked_fill(
            ~allowed, torch.finfo(dtype).min)
    return allowed


# The HF attention kwarg carrying the ring place's document ids (None: causal) to the ring.
RING_DOCUMENTS = "blocktrain_ring_documents"
# An attention's keyword arguments -> (document ids or None, scale or None, dropout)
RingOptions = Callable[[dict], tuple]


def llama_ring_options(options: dict) -> tuple:
    """The built-in attention's arguments (trainer/models/llama.py): `mask` carries the ring
    place's document ids under the ring (sliced_rope_and_mask), the scale is SDPA's."""
    return options.get("mask"), None, options.get("dropout_p", 0.0)


def ring_wrap(group: dist.ProcessGroup, options: RingOptions = llama_ring_options
              ) -> Callable[[Attend], Attend]:
    """A wrap for a family's `wrap_attention`: attention over the ring `group` (sharding/
    ring.py) in place of the wrapped kernel, which it does not call: the ring runs torch's
    kernels that return the log-sum-exp its merge needs. `options` reads the document ids
    [B, T/M] (packed rows; `ring_documents`) or None (causal), the scale and the dropout
    from the attention's keyword arguments (the family's: the built-in's or HF's). Wrapped
    inside Ulysses' wrap, it sees the ring place's tokens and the Ulysses rank's heads."""
    def wrap(current: Attend) -> Attend:
        def attend(q, k, v, **kwargs):
            documents, scale, dropout = options(kwargs)
            if dropout:
                raise ValueError("ring attention has no attention dropout: set the model's "
                                 "attention dropout to 0 with sharding.context > 1")
            if documents is not None and documents.dim() != 2:
                raise ValueError(f"ring attention takes document ids [B, T] for packed rows, "
                                 f"got shape {tuple(documents.shape)}")
            return ring_attention(q, k, v, group, causal=True, scale=scale,
                                  documents=documents)
        attend.exchanges_tokens = True  # query tiles must not slice the ring place's tokens
        return attend
    return wrap


def hf_ring_kwargs(tokens: torch.Tensor, positions: Optional[torch.Tensor],
                   sequence_group: Optional[dist.ProcessGroup],
                   context_group: dist.ProcessGroup) -> dict:
    """HF's keyword arguments for this rank's share under the ring: the true positions of its
    tokens (rotary angles) and the ring place's document ids (None: unpacked, causal), which
    the ring reads instead of HF's share-sized mask (trainer/models/hf.py's ring_options)."""
    if positions is not None:
        return {"position_ids": positions,
                RING_DOCUMENTS: ring_documents(positions, sequence_group, context_group)}
    s_rank, n = group_place(sequence_group)
    c_rank, m = group_place(context_group)
    at = sample_positions(tokens.shape[1] * n * m, c_rank, m, s_rank, n, tokens.device)
    return {"position_ids": at.expand(tokens.shape[0], -1), RING_DOCUMENTS: None}


def ring_documents(positions: torch.Tensor, sequence_group: Optional[dist.ProcessGroup],
                   context_group: dist.ProcessGroup) -> torch.Tensor:
    """The document ids [B, T/M] of the tokens this rank's ring place holds, numbered over the
    whole sample (a document crossing ring places keeps its id): from the rank's slice of the
    packed positions, gathered over its Ulysses group and then the ring."""
    from trainer.models.doc_attention import document_ids

    whole = gather_ring(whole_positions(positions, sequence_group), context_group)
    rank, size = group_place(context_group)
    return balanced_slice(document_ids(whole), rank, size)


def sliced_rope_and_mask(tokens: torch.Tensor, positions: Optional[torch.Tensor],
                         head_dim: int, theta: float, backend: str,
                         sequence_group: Optional[dist.ProcessGroup],
                         context_group: Optional[dist.ProcessGroup]) -> tuple[tuple, tuple]:
    """(rotary tables, the blocks' extra arguments) of the built-in Llama for this rank's
    tokens: angles at the tokens' true positions in the sample; for packed rows the document
    mask of the whole sequence (Ulysses: built from the gathered positions, `backend` sdpa or
    flex) or the ring place's document ids (the ring). Unpacked rows: no extra argument."""
    from trainer.models.doc_attention import check_positions, document_mask
    from trainer.models.rope import rope_at, rope_cos_sin

    s_rank, n = group_place(sequence_group)
    c_rank, m = group_place(context_group)
    if positions is None:
        seq_len = tokens.shape[1] * n * m
        rope = rope_cos_sin(head_dim, seq_len, theta, tokens.device)
        if n * m > 1:  # the angles of this rank's tokens in the whole sequence
            at = sample_positions(seq_len, c_rank, m, s_rank, n, tokens.device)
            rope = tuple(t[at] for t in rope)
        return rope, ()
    check_positions(tokens, positions)
    rope = rope_at(positions, head_dim, theta)
    if m > 1:
        return rope, (ring_documents(positions, sequence_group, context_group),)
    # Built once and shared: it is O(B * T * T) (sdpa) or a compiled pass (flex).
    return rope, (document_mask(whole_positions(positions, sequence_group), backend),)
