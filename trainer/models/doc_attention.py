"""Document-masked attention of packed sequences for the built-in Llama: several documents share
one window, and attention never crosses from one to another.

A packed micro-batch carries ``positions`` ([B, T] integers) beside the tokens. A token whose
position is not its left neighbour's plus one starts a new document (the first token of a row
always does), the rule transformers' ``find_packed_sequence_indices`` uses, so a window that
starts mid-document (positions 37, 38, ...) is one document continuing. Attention is causal
and never crosses a document boundary.

Two ways to apply that mask, chosen once per forward and shared by every block:

* ``sdpa``: a boolean [B, 1, T, T] mask for ``scaled_dot_product_attention``. Exact on every
  device and the only path off CUDA; it costs T * T bytes per row, which is negligible at the
  lengths a CPU trains but not at 32k on a GPU.
* ``flex``: a FlexAttention ``BlockMask`` (CUDA). Only blocks that hold an allowed pair are
  computed, so packing costs no dense mask and skips the cross-document blocks. The kernel is
  the compiled ``flex_attention``; off CUDA it runs uncompiled (slow, reference maths), which
  lets the CPU tests check the block-mask logic against the ``sdpa`` path.

``auto`` takes ``flex`` on CUDA unless attention dropout is active (FlexAttention has no
dropout), and ``sdpa`` everywhere else, meta included.
"""

from __future__ import annotations

from typing import Callable, Optional, Union

import torch
import torch.nn.functional as F

BACKENDS = ("auto", "sdpa", "flex")

# What blocks receive: a boolean SDPA mask or a FlexAttention BlockMask (typed loosely so that
# importing this module does not import flex_attention).
DocumentMask = Union[torch.Tensor, object]

_compiled_flex: Optional[Callable] = None


def check_positions(tokens: torch.Tensor, positions: torch.Tensor) -> None:
    """Shape and dtype only: reading values would force a device sync every step."""
    if positions.shape != tokens.shape:
        raise ValueError(f"positions must have the tokens' shape {tuple(tokens.shape)}, "
                         f"got {tuple(positions.shape)}")
    if positions.dtype.is_floating_point or positions.dtype == torch.bool:
        raise ValueError(f"positions must be an integer tensor (int64), got {positions.dtype}")
    if positions.device != tokens.device:
        raise ValueError(f"positions are on {positions.device}, tokens on {tokens.device}")


def document_ids(positions: torch.Tensor) -> torch.Tensor:
    """[B, T] int64: 0 for the row's first document, +1 at every restart of the positions."""
    starts = positions[:, 1:] != positions[:, :-1] + 1
    first = torch.zeros_like(positions[:, :1], dtype=torch.long)
    return torch.cat((first, starts.long().cumsum(dim=1)), dim=1)


def choose_backend(backend: str, device: torch.device, dropout_active: bool) -> str:
    if backend not in BACKENDS:
        raise ValueError(f"packed attention backend {backend!r}: use one of {BACKENDS}")
    if backend == "auto":
        return "flex" if device.type == "cuda" and not dropout_active else "sdpa"
    if backend == "flex" and dropout_active:
        raise ValueError("packed attention backend 'flex' has no attention dropout; set the "
                         "dropout to 0 or use 'sdpa'/'auto'")
    return backend


def document_mask(positions: torch.Tensor, backend: str) -> DocumentMask:
    """The mask every block applies, built once per forward (``backend``: sdpa or flex)."""
    docs = document_ids(positions)
    if backend == "flex":
        return _block_mask(docs)
    seq_len = docs.shape[1]
    causal = torch.ones(seq_len, seq_len, dtype=torch.bool, device=docs.device).tril()
    same_document = docs.unsqueeze(2) == docs.unsqueeze(1)
    return (same_document & causal).unsqueeze(1)


def _block_mask(docs: torch.Tensor):
    from torch.nn.attention.flex_attention import create_block_mask

    def causal_same_document(b, h, q_idx, kv_idx):
        return (q_idx >= kv_idx) & (docs[b, q_idx] == docs[b, kv_idx])

    batch, seq_len = docs.shape
    # Heads share the mask (H=None broadcasts). Compiled on CUDA so that the dense B x T x T
    # mask is never materialised while the block summary is built.
    return create_block_mask(causal_same_document, batch, None, seq_len, seq_len,
                             device=docs.device, _compile=docs.device.type == "cuda")


def _flex_attention() -> Callable:
    """torch.compile(flex_attention), made once per process on first use: uncompiled, flex
    runs its reference maths, which materialises every score."""
    global _compiled_flex
    if _compiled_flex is None:
        from torch.nn.attention.flex_attention import flex_attention

        _compiled_flex = torch.compile(flex_attention, dynamic=False)
    return _compiled_flex


def masked_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: DocumentMask,
                     dropout_p: float, enable_gqa: bool) -> torch.Tensor:
    """Attention of [B, heads, T, head_dim] q, k, v under a document mask."""
    if isinstance(mask, torch.Tensor):
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=dropout_p,
                                              enable_gqa=enable_gqa)
    if dropout_p > 0:
        raise ValueError("FlexAttention has no attention dropout (choose_backend avoids this)")
    if q.device.type == "cuda":
        return _flex_attention()(q, k, v, block_mask=mask, enable_gqa=enable_gqa)
    from torch.nn.attention.flex_attention import flex_attention

    return flex_attention(q, k, v, block_mask=mask, enable_gqa=enable_gqa)
