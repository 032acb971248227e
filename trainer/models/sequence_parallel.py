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

from sharding.sequence import gather_sequence, kv_repeats, ulysses_attention
from trainer.models.hf_settings import HF_IMPLEMENTATIONS  # re-exported: the torch-free list

Attend = Callable[..., torch.Tensor]
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


def ulysses_wrap(group: dist.ProcessGroup) -> Callable[[Attend], Attend]:
    """A wrap for a family's `wrap_attention`: the built-in models' attend(q, k, v, **options)
    ([B, heads, T/N, head_dim] in and out) runs over whole sequences through the all-to-all.
    Options (the whole-sequence mask, dropout, enable_gqa) pass through unchanged."""
    def wrap(current: Attend) -> Attend:
        def attend(q, k, v, **options):
            return ulysses_attention(current, q, k, v, group, **options)
        return attend
    return wrap


def hf_ulysses_wrap(group: dist.ProcessGroup) -> Callable[[Attend], Attend]:
    """The same for HF attention modules (trainer/models/hf.py's attend): HF's slice-sized
    `attention_mask` is replaced by the whole-sequence one the wrapper's forward put in the
    SEQUENCE_MASK kwarg (None: causal over the whole sequence, SDPA's is_causal)."""
    def wrap(current: Attend) -> Attend:
        def attend(q, k, v, attention_mask=None, **options):
            mask = options.pop(SEQUENCE_MASK, None)
            options.pop("position_ids", None)  # the slice's: meaningless after the all-to-all
            if kv_repeats(q.shape[1], k.shape[1], dist.get_world_size(group)) > 1:
                # HF repeats KV heads by the module's own group size after the all-to-all.
                raise ValueError(f"sequence degree {dist.get_world_size(group)} must divide "
                                 f"the model's KV heads {k.shape[1]} for an HF model")
            return ulysses_attention(current, q, k, v, group, attention_mask=mask, **options)
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
