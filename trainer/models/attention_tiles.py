"""The built-in Llama's (and Qwen3's) attention in sequence tiles (Block.tile): after the input
side (attention_norm, wq/wk/wv, computed in tiles by checkpointing/tiles.py), rotary runs per tile,
and attention itself runs by query tiles with `wo` inside them (checkpointing/query_tiles.py), so
no whole-sequence fp32 rotary copy, attention output or GPU dq accumulator exists at once.

- Keys: each tile's keys are head-normed (Qwen3) and rotated in float32, then kept rotated in the
  model's dtype for every query tile's prefix ([B, kv_heads, T, head_dim], what a whole-sequence
  attention holds as well).
- Queries: tile [s, e) is head-normed and rotated, attends keys [0, e) under a bottom-right
  causal mask (packed rows: the rows of the document mask), one KV head's group at a time with
  grouped-query heads, and goes through `wo`; the result is the block's attention output for
  those tokens.

Whole attention instead (queries still rotated per tile, `wo` whole) where a query tile cannot
stand for it: attention dropout (a tile draws other masks than the whole [T, T] dropout), Ulysses
(its all-to-alls exchange whole sequences: trainer/models/sequence_parallel.py), and packed rows
under FlexAttention (a BlockMask is not sliced here).
"""

from __future__ import annotations

import functools
from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

from checkpointing.query_tiles import lower_right_attention, query_tiled
from checkpointing.tiles import mark_tiled, tile_sizes, tiled
from trainer.models.rope import Rope, apply_rope


class QueryTiles(nn.Module):
    """One query tile of an attention module (parameterless: its forward reads the attention's
    own weights). A module so that the planner's trace sees the tiles' recompute, attention and
    wo included (checkpointing/tiles.py's mark_tiled)."""

    def forward(self, attention: nn.Module, q_tile: torch.Tensor, keys: torch.Tensor,
                values: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                mask_rows: Optional[torch.Tensor] = None) -> torch.Tensor:
        batch, tokens, _ = q_tile.shape
        q = _rotated(attention, "q_norm", q_tile, attention.n_heads, (cos, sin)).transpose(1, 2)
        gqa = attention.n_kv_heads != attention.n_heads
        if mask_rows is None:
            out = _by_key_head(q, keys, values) if gqa else lower_right_attention(q, keys, values)
        else:  # packed rows: the document mask's rows of this tile, over the key prefix
            out = F.scaled_dot_product_attention(q, keys, values, enable_gqa=gqa,
                                                 attn_mask=mask_rows[..., :keys.shape[2]])
        return attention.wo(out.transpose(1, 2).reshape(batch, tokens, -1))


def _by_key_head(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
    """Grouped-query attention one KV head (and its group of query heads) at a time: a GPU
    flash backward expands dK and dV to the query heads of its call ([B, prefix, heads, d],
    attention_workspace.py), so one group's call expands to its group only, 1/kv_heads of it."""
    group = q.shape[1] // keys.shape[1]
    return torch.cat([lower_right_attention(q[:, h * group:(h + 1) * group], keys[:, h:h + 1],
                                            values[:, h:h + 1], enable_gqa=True)
                      for h in range(keys.shape[1])], dim=1)


def add_query_tiles(attention: nn.Module, num_tiles: int) -> None:
    """Give `attention` its query tiles (Block.tile), marked for the planner."""
    attention.query_tiles = QueryTiles()
    mark_tiled(attention.query_tiles, num_tiles)


def _rotated(attention: nn.Module, norm: str, x: torch.Tensor, heads: int,
             rope: Rope) -> torch.Tensor:
    """[B, t, heads * head_dim] -> [B, t, heads, head_dim], head-normed where the family has a
    head norm (Qwen3's q_norm / k_norm), rotated (apply_rope: in float32, back in x's dtype)."""
    batch, tokens, _ = x.shape
    heads_view = x.view(batch, tokens, heads, attention.head_dim)
    head_norm = getattr(attention, norm, None)
    return apply_rope(heads_view if head_norm is None else head_norm(heads_view), rope)


@torch.compiler.disable  # eager, as the tiles (checkpointing/tiles.py) are
def rotated_in_tiles(attention: nn.Module, norm: str, x: torch.Tensor, heads: int, rope: Rope,
                     num_tiles: int) -> torch.Tensor:
    """[B, T, heads, head_dim]: x [B, T, heads * head_dim] head-normed (where the family has
    the head norm `norm`) and rotated, in `num_tiles` sequence tiles. Rotation alone keeps
    nothing for backward (`_Rotation`); a head norm needs its input, which the tiles keep."""
    cos, sin = rope
    head_norm = getattr(attention, norm, None)
    if head_norm is None:
        return _Rotation.apply(x, cos, sin, heads, attention.head_dim, num_tiles)
    rows = 1 if cos.dim() == 3 else 0  # per token [B, T, d/2] (packed) or [T, d/2]

    def rotate(tile: torch.Tensor, cos_tile: torch.Tensor, sin_tile: torch.Tensor):
        return _rotated(attention, norm, tile, heads, (cos_tile, sin_tile))

    return tiled(rotate, x, num_tiles, _trained(head_norm), aligned=[(cos, rows), (sin, rows)])


class _Rotation(torch.autograd.Function):
    """Rotary in sequence tiles that keeps nothing for backward: a rotation's gradient is the
    inverse rotation of the output's gradient (apply_rope(inverse=True): autograd's products
    and sums, bit for bit). Recomputing the tiles instead would keep the input, a view that
    holds the whole q/k/v projection alive until backward (under Ulysses and the ring the
    all-to-all copies q, k and v, so nothing else needs it)."""

    @staticmethod
    def forward(ctx, x, cos, sin, heads: int, head_dim: int, num_tiles: int):
        ctx.rope, ctx.num_tiles = (cos, sin), num_tiles
        batch, tokens, _ = x.shape
        return _rotate_tiles(x.view(batch, tokens, heads, head_dim), cos, sin, num_tiles)

    @staticmethod
    def backward(ctx, grad):
        grad_x = _rotate_tiles(grad, *ctx.rope, ctx.num_tiles, inverse=True).flatten(2)
        return grad_x, None, None, None, None, None


def _rotate_tiles(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, num_tiles: int,
                  inverse: bool = False) -> torch.Tensor:
    rows = 1 if cos.dim() == 3 else 0
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    offset = 0
    for size in tile_sizes(x.shape[1], num_tiles):
        tile_rope = (cos.narrow(rows, offset, size), sin.narrow(rows, offset, size))
        out.narrow(1, offset, size).copy_(apply_rope(x.narrow(1, offset, size), tile_rope,
                                                     inverse))
        offset += size
    return out


def _trained(*modules: Optional[nn.Module]) -> list[torch.Tensor]:
    return [p for m in modules if m is not None for p in m.parameters() if p.requires_grad]


def _whole(attention: nn.Module, mask) -> bool:
    """Whether attention must see whole sequences (see the module docstring)."""
    dropout = attention.dropout if attention.training else 0.0
    return (dropout > 0 or getattr(attention.attend, "exchanges_tokens", False)
            or (mask is not None and not isinstance(mask, torch.Tensor)))


def tiled_attention(attention: nn.Module, qkv: torch.Tensor, rope: Rope, mask,
                    num_tiles: int) -> torch.Tensor:
    """wo(attention) of the [B, T, (heads + 2 kv heads) * head_dim] projections, in tiles."""
    q, k, v = attention.split(qkv)
    batch, tokens, _ = q.shape
    cos, sin = rope
    rows = 1 if cos.dim() == 3 else 0  # per token [B, T, d/2] (packed) or [T, d/2]
    aligned = [(cos, rows), (sin, rows)]
    kv_heads = attention.n_kv_heads
    keys = rotated_in_tiles(attention, "k_norm", k, kv_heads, rope, num_tiles).transpose(1, 2)
    values = v.view(batch, tokens, kv_heads, attention.head_dim).transpose(1, 2)
    q_norm = getattr(attention, "q_norm", None)
    if _whole(attention, mask):
        queries = rotated_in_tiles(attention, "q_norm", q, attention.n_heads, rope,
                                   num_tiles).transpose(1, 2)
        out = attention.attend(queries, keys, values, mask=mask,
                               dropout_p=attention.dropout if attention.training else 0.0,
                               enable_gqa=kv_heads != attention.n_heads)
        return attention.wo(out.transpose(1, 2).reshape(batch, tokens, -1))
    if mask is not None:
        aligned.append((mask, 2))  # the rows of a boolean [B, 1, T, T] document mask
    tile = functools.partial(attention.query_tiles, attention)
    return query_tiled(tile, q, keys, values, num_tiles, _trained(q_norm, attention.wo), aligned)
