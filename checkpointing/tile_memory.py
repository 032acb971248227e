"""Sequence tiles in numbers, without torch: how a sequence splits into tiles, and the peak bytes
of an MLP's backward untiled and tiled. The planner and the report do not use the formula: they
trace the tiled code itself on meta (trainer/preflight/scenario.py), the built-in Llama's tiled
norms and projections included; it stays as the MLP's closed form, held to CPU by the tests.

Kept apart from checkpointing/tiles.py (which runs them) so that planning code can count tiles
without importing torch.
"""

from __future__ import annotations

from typing import Optional

# [tokens, hidden] tensors alive at the peak of an MLP's recompute-and-backward (torch 2.13,
# CPU, fp32 and bf16, tests/test_tiles.py):
#   gated (SwiGLU, w2(act(w1 x) * w3 x)): six: w1 x, w3 x, act(w1 x) and their product, saved
#     by the recompute, with the gradients of the product and of one factor.
#   plain (w2(act(w1 x))): three: w1 x and act(w1 x), saved, with the gradient of the second.
HIDDEN_COPIES = {"gated": 6, "plain": 3}
WEIGHTS = {"gated": 3, "plain": 2}  # [dim, hidden] weight matrices


def tile_sizes(length: int, tiles: int) -> list[int]:
    """Token counts of `tiles` consecutive tiles of `length` tokens: as even as possible, the
    first length % tiles of them one token longer."""
    if tiles < 1:
        raise ValueError(f"tiles must be >= 1, got {tiles}")
    if tiles > length:
        raise ValueError(f"{tiles} tiles for {length} tokens: at most one tile per token")
    base, longer = divmod(length, tiles)
    return [base + 1] * longer + [base] * (tiles - longer)


def mlp_backward_peak_bytes(batch: int, seq_len: int, dim: int, hidden: int, itemsize: int,
                            tiles: int = 1, kind: str = "gated",
                            grad_itemsize: Optional[int] = None) -> int:
    """Peak bytes an MLP's backward adds to what exists before it (its saved input, the output
    gradient, the weights) when it keeps only its input and recomputes; as measured on CPU by
    tests/test_tiles.py, where tokens far outnumber `dim` (the long sequences tiles are for).

    tiles=1: the whole [tokens, hidden] intermediates at once (a checkpointed MLP), its input
    gradient and the first weight gradient formed.
    tiles=n: the intermediates of the longest tile; that tile's input gradient beside copies of
    its input and output-gradient slices when batch > 1 (a slice of the sequence is then not
    contiguous); the whole input gradient being written tile by tile; the
    weight gradients' running sums (float32 for 16-bit weights) and two fresh tile gradients.
    grad_itemsize: bytes per element of the weight gradients (default: itemsize).
    """
    if kind not in HIDDEN_COPIES:
        raise ValueError(f"MLP kind {kind!r}: use one of {sorted(HIDDEN_COPIES)}")
    tokens, longest = batch * seq_len, batch * max(tile_sizes(seq_len, tiles))
    grad_itemsize = grad_itemsize or itemsize
    weight = dim * hidden
    intermediates = HIDDEN_COPIES[kind] * longest * hidden * itemsize
    if tiles == 1:
        return intermediates + tokens * dim * itemsize + weight * grad_itemsize
    sum_itemsize = 4 if grad_itemsize < 4 else grad_itemsize
    tile_rows = 3 if batch > 1 else 1
    return (intermediates + tile_rows * longest * dim * itemsize + tokens * dim * itemsize
            + WEIGHTS[kind] * weight * sum_itemsize + 2 * weight * grad_itemsize)
