"""How a meta `scaled_dot_product_attention` call stands for the kernel a GPU (or the CPU) runs:
the CPU flash kernel, whose meta kernel and autograd formula keep what the fused kernels keep
(q, k, v, the output and a [B, H, T] fp32 log-sum-exp) and whose grouped-query k and v stay as
they are (metatrace.FusedAttentionOnMeta calls `fused_on_meta`).

Query tiles (checkpointing/query_tiles.py) call attention with a bottom-right causal bias
(torch.nn.attention.bias.causal_lower_right): on a GPU, FlashAttention-2 runs it as its own
causal mask, so it stands here as a causal flash call of the tile's shapes (a [t, e] query tile
against its key prefix). The CPU materialises that bias as an additive float mask, which its
flash kernel keeps for backward: like_cpu passes the same mask, so its bytes are counted.
"""

from __future__ import annotations

from typing import Optional

import torch
from torch.nn.attention.bias import CausalBias, CausalVariant

FLASH_CPU = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu


def fused_on_meta(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                  attn_mask: Optional[torch.Tensor] = None, dropout_p: float = 0.0,
                  is_causal: bool = False, scale: Optional[float] = None,
                  enable_gqa: bool = False, like_cpu: bool = False) -> Optional[torch.Tensor]:
    """The output of the fused stand-in, or None to let the original call run (not meta; an
    explicit mask, which a GPU runs in the efficient kernel that saves it too; the CPU's math
    path for dropout)."""
    if query.device.type != "meta":
        return None
    if like_cpu and dropout_p > 0:
        return None  # the CPU's math path, which meta takes as well
    if key.shape[-3] != query.shape[-3] and not enable_gqa:
        return None  # let the original report the shape mismatch
    mask = None
    if isinstance(attn_mask, CausalBias) and attn_mask.variant == CausalVariant.LOWER_RIGHT:
        is_causal = not like_cpu
        if like_cpu:  # as sdpa converts the CPU's boolean mask: additive, the query's dtype
            allowed = attn_mask._materialize(query.device)
            mask = torch.zeros(allowed.shape, dtype=query.dtype, device=query.device)
    elif attn_mask is not None:
        return None
    output, _ = FLASH_CPU(query, key, value, dropout_p, is_causal, attn_mask=mask, scale=scale)
    return output
