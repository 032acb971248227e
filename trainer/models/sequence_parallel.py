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

The group lives on the model (`model.sequence_group`, set by the family's `sequence_parallel`)
and everything per forward travels through the forward's own arguments (the block's mask, HF's
attention kwargs), so activation checkpointing recomputes it from the block's inputs.
"""

from __future__ import annotations

from typing import Callable, Optional

import torch
import torch.distributed as dist

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
