"""Rotary position embeddings: the tables (fp32, from positions or 0..T-1) and the rotation."""

from __future__ import annotations

import torch

from checkpointing.head import compute_dtype

Rope = tuple[torch.Tensor, torch.Tensor]


def rope_cos_sin(head_dim: int, seq_len: int, theta: float, device: torch.device) -> Rope:
    """Rotary tables ``(cos, sin)``, each float32 of shape ``[seq_len, head_dim // 2]``.

    Built per forward instead of kept as buffers: the cost is negligible next to
    one matmul, and it leaves nothing to re-create after meta-device construction.
    """
    positions = torch.arange(seq_len, dtype=torch.float32, device=device)
    angles = torch.outer(positions, _inv_freq(head_dim, theta, device))
    return torch.cos(angles), torch.sin(angles)


def rope_at(positions: torch.Tensor, head_dim: int, theta: float) -> Rope:
    """Rotary tables for given token positions ([B, T] integers): ``(cos, sin)``, each float32
    of shape ``[B, T, head_dim // 2]``; at positions 0..T-1 the same numbers as rope_cos_sin.

    Computed from the positions rather than gathered from a table, so a document continued
    past ``max_seq_len`` from an earlier window needs no larger table.
    """
    inv_freq = _inv_freq(head_dim, theta, positions.device)
    # The same single fp32 product per element as torch.outer in rope_cos_sin.
    angles = positions.float().unsqueeze(-1) * inv_freq
    return torch.cos(angles), torch.sin(angles)


def _inv_freq(head_dim: int, theta: float, device: torch.device) -> torch.Tensor:
    exponents = torch.arange(0, head_dim, 2, dtype=torch.float32, device=device) / head_dim
    return 1.0 / (theta**exponents)


def apply_rope(x: torch.Tensor, rope: Rope, inverse: bool = False) -> torch.Tensor:
    """Rotate ``x`` of shape ``[B, T, heads, head_dim]`` by position.

    Uses Meta's interleaved convention: feature pairs ``(2i, 2i+1)`` are the real
    and imaginary parts of one complex number that is multiplied by
    ``exp(j * pos * freq_i)``. The rotation runs in float32 (float64 for a float64
    x) because bf16 angles lose relative-position precision at long sequence lengths.

    inverse: rotate by the negated angles, which is the rotation's gradient: for the
    gradient of the output it gives, bit for bit, the products and sums autograd forms.
    """
    cos, sin = rope
    seq_len = x.shape[1]
    if cos.dim() == 3:  # per token ([B, T, head_dim // 2], packed): broadcast over heads
        cos, sin = cos.unsqueeze(2), sin.unsqueeze(2)
    else:
        cos = cos[:seq_len].view(1, seq_len, 1, -1)
        sin = sin[:seq_len].view(1, seq_len, 1, -1)
    pairs = x.to(compute_dtype(x.dtype)).unflatten(-1, (-1, 2))
    real, imag = pairs[..., 0], pairs[..., 1]
    if inverse:
        rotated = torch.stack((real * cos + imag * sin, imag * cos - real * sin), dim=-1)
    else:
        rotated = torch.stack((real * cos - imag * sin, real * sin + imag * cos), dim=-1)
    return rotated.flatten(-2).type_as(x)
