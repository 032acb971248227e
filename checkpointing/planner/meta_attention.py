"""How a meta `scaled_dot_product_attention` call stands for the kernel a GPU (or the CPU) runs:
the CPU flash kernel, whose meta kernel and autograd formula keep what the fused kernels keep
(q, k, v, the output and a [B, H, T] fp32 log-sum-exp) and whose grouped-query k and v stay as
they are (metatrace.FusedAttentionOnMeta calls `fused_on_meta`).

Query tiles call `checkpointing.query_tiles.lower_right_attention` (a [t, e] query tile against
its key prefix, causal from the bottom right): on a GPU FlashAttention-2 runs it with its own
causal mask, so it stands here as a causal flash call of the tile's shapes; like_cpu runs what
the CPU runs (reversed queries and a one-row mask), so its copies are counted.
"""

from __future__ import annotations

from typing import Optional

import torch

from checkpointing.query_tiles import cpu_mask

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
    if attn_mask is not None:
        return None
    output, _ = FLASH_CPU(query, key, value, dropout_p, is_causal, scale=scale)
    return output


def lower_right_on_meta(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                        enable_gqa: bool = False, like_cpu: bool = False) -> torch.Tensor:
    """The stand-in for lower_right_attention on meta (see the module docstring)."""
    if not like_cpu:
        return FLASH_CPU(q, k, v, 0.0, True)[0]
    mask = cpu_mask(q.shape[-2], k.shape[-2], q)  # the CPU's: reversed rows, one row of mask
    return FLASH_CPU(q.flip(-2), k, v, 0.0, False, attn_mask=mask)[0].flip(-2)


def attention_flops(query_shape, key_shape, value_shape, *args, out_shape=None, **kwargs) -> int:
    """The two attention matmuls (scores, then probabilities x values) over the (query, key)
    pairs a kernel computes: all of them, or with is_causal the causal ones, aligned to the
    bottom right as flash kernels do (query i of q_len sees k_len - q_len + i + 1 keys: half the
    square for whole attention, a query tile's prefix for tiles). The CUDA kernels skip the
    masked blocks, so counting them (as FlopCounterMode's own formula does) doubles attention."""
    batch, heads, q_len, head_dim = query_shape
    k_len, v_dim = key_shape[-2], value_shape[-1]
    causal = kwargs.get("is_causal", args[1] if len(args) > 1 else False)
    pairs = q_len * k_len - (q_len * (q_len - 1) // 2 if causal and q_len <= k_len else 0)
    return 2 * batch * heads * pairs * head_dim + 2 * batch * heads * pairs * v_dim


EFFICIENT = torch.ops.aten._scaled_dot_product_efficient_attention


def efficient_attention_flops(query_shape, key_shape, value_shape, bias_shape=None,
                              compute_log_sumexp=False, dropout_p=0.0, is_causal=False, *args,
                              out_shape=None, **kwargs) -> int:
    """attention_flops for CUDA's memory-efficient kernel, which ring attention calls itself
    (sharding/ring_kernels.py; on meta too): its own-keys step is causal, the others are not."""
    return attention_flops(query_shape, key_shape, value_shape, dropout_p,
                           kwargs.get("is_causal", is_causal))


# The attention ops the meta trace meets, with their causal-aware FLOP formulas.
ATTENTION_FLOPS = {FLASH_CPU: attention_flops, EFFICIENT: efficient_attention_flops}
