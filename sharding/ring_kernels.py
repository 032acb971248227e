"""What the ring (sharding/ring.py) does at one step: torch's attention kernels, called one query
head at a time, and the exact merge of their partial results.

Per query head. A call gets one query head and the one KV head it reads ([B, 1, Tq, D] and
[B, 1, Tk, D]), so grouped-query heads need no repeated K/V (a KV head is read by each of its
group's calls), and what a call allocates (its output, its gradients, the CUDA backward's fp32
dq accumulator) is one head's: at a million tokens a rank these temporaries are the largest
tensors of the block after q, k, v themselves. The accumulators are per head too, so the
output and dq come back in the model's dtype one head at a time.

Kernels. CPU: the flash kernel (it returns the log-sum-exp the merge needs and takes an
additive mask). CUDA, and the meta trace that predicts a GPU run: the memory-efficient kernel
(log-sum-exp and an additive mask, for packed rows' document masks).
"""

from __future__ import annotations

from typing import Optional

import torch

NEG_INF = float("-inf")


class CpuFlash:
    """The CPU flash kernel: returns the log-sum-exp the merge needs; takes an additive mask of
    the query's dtype. A row whose keys are all masked comes back with lse 0 and a zero output
    (not -inf): `attend` marks such rows itself."""

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


def kv_head(q_heads: int, kv_heads: int, head: int) -> int:
    """The KV head query head `head` reads: the grouping of repeat_interleave / enable_gqa."""
    return head // (q_heads // kv_heads)


def attend(kernel, q, k, v, mask, causal, scale, seen: Optional[torch.Tensor] = None):
    """(out, lse) of q against one key block, q and k/v with the same number of heads; rows
    with no visible key get lse -inf (`seen` [B, 1, Tq]: the mask's rows that see a key)."""
    out, lse = kernel.forward(q, k, v, causal, mask, scale)
    if mask is not None:
        seen = (mask == 0).any(dim=-1) if seen is None else seen
        lse = lse.masked_fill(~seen, NEG_INF)
    return out, lse


def merge(out_acc, lse_acc, out, lse, rows: slice) -> None:
    """Fold a block's (out, lse) into the running fp32 result, in place, for `rows`: the
    softmax over the union of keys. The running lse is finite (step 0 sees each row's own
    key), so a block's -inf rows weigh exactly 0."""
    acc, acc_lse = out_acc[:, :, rows], lse_acc[:, :, rows]
    lse = lse.float()
    new = torch.logaddexp(acc_lse, lse)
    acc.mul_((acc_lse - new).exp_().unsqueeze(-1))
    acc.addcmul_(out, (lse - new).exp_().unsqueeze(-1))
    acc_lse.copy_(new)


def attend_heads(kernel, q, k, v, out_acc: list, lse_acc, queries: slice, keys: slice, mask,
                 causal: bool, scale: float) -> None:
    """One ring step's attention, one query head at a time, merged into the per-head fp32
    accumulators `out_acc` ([B, 1, T, D] each) and `lse_acc` [B, H, T]."""
    seen = (mask == 0).any(dim=-1) if mask is not None else None
    for head, acc in enumerate(out_acc):
        j = kv_head(q.shape[1], k.shape[1], head)
        out, lse = attend(kernel, q[:, head:head + 1, queries], k[:, j:j + 1, keys],
                          v[:, j:j + 1, keys], mask, causal, scale, seen)
        merge(acc, lse_acc[:, head:head + 1], out, lse, queries)
        del out, lse  # before the next head's call makes its own


def attend_heads_backward(kernel, grad_out, q, k, v, out, lse, dq_acc: list, dk_acc, dv_acc,
                          queries: slice, keys: slice, mask, causal: bool, scale: float) -> None:
    """One ring step's gradients, one query head at a time, from the merged output and lse
    (the block's probabilities are exp(scores - merged lse): exact shares of the whole
    softmax), added in place: dq into the per-head fp32 `dq_acc`, dK/dV into the fp32
    `dk_acc` / `dv_acc` of the visiting block (a group's heads sum into their KV head)."""
    for head, acc in enumerate(dq_acc):
        j = kv_head(q.shape[1], k.shape[1], head)
        one = slice(head, head + 1)
        dq, dk, dv = kernel.backward(
            grad_out[:, one, queries].contiguous(), q[:, one, queries].contiguous(),
            k[:, j:j + 1, keys].contiguous(), v[:, j:j + 1, keys].contiguous(),
            out[:, one, queries].contiguous(), lse[:, one, queries].contiguous(), causal, mask,
            scale)
        acc[:, :, queries] += dq
        dk_acc[:, j:j + 1, keys] += dk
        dv_acc[:, j:j + 1, keys] += dv
        del dq, dk, dv


def per_head_zeros(like: torch.Tensor) -> list:
    """One fp32 accumulator [B, 1, T, D] per head of `like` [B, H, T, D]."""
    shape = (like.shape[0], 1, *like.shape[2:])
    return [torch.zeros(shape, dtype=torch.float32, device=like.device)
            for _ in range(like.shape[1])]


def heads_joined(parts: list, like: torch.Tensor) -> torch.Tensor:
    """[B, H, T, D] in `like`'s dtype from per-head fp32 accumulators, freeing each one as soon
    as it is copied (so the fp32 and the joined copy never both exist whole)."""
    joined = torch.empty(like.shape, dtype=like.dtype, device=like.device)
    for head in range(len(parts)):
        joined[:, head:head + 1].copy_(parts[head])
        parts[head] = None
    return joined
