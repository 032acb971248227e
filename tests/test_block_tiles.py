"""The built-in Llama's block in sequence tiles (Block.tile: attention_norm with wq/wk/wv, and
ffn_norm with the MLP) and its final norm tiled before the head (Llama.tile_head): the loss and
every gradient within 1e-6 of the untiled model, dropout on, plain and chunked head, all rows
and supervised rows; one tile is the untiled code bit for bit; and the tiled block's backward
holds less than the untiled one (what the tiles are for). Through the trainer (checkpointing,
offload, compile, sequence parallel): tests/test_sequence_runs.py."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from checkpointing.head import supervised_rows
from trainer.models.llama import (IGNORE_INDEX, LlamaArgs, build_llama, next_token_loss_sum,
                                 rope_cos_sin)
from trainer.models.qwen3 import build_qwen3
from trainer.observe.livebytes import LiveTensorBytes

ARGS = LlamaArgs(dim=32, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=64, ffn_hidden=64,
                 max_seq_len=64, dropout=0.1)


# Qwen3: Llama's blocks with per-head q/k norms (outside the tiles) and heads of 16 on a dim of 32.
BUILDERS = {"llama": build_llama, "qwen3": build_qwen3}


def _pair(tiles: int, model: str = "llama", base: LlamaArgs = ARGS,
          head: bool = True) -> tuple[torch.nn.Module, torch.nn.Module]:
    """An untiled model and its tiled twin with the same weights (head: tile the final norm
    and head too)."""
    args = base if model == "llama" else dataclasses.replace(base, head_width=16)
    torch.manual_seed(0)
    plain = BUILDERS[model](args, device="cpu")
    for p in plain.parameters():
        torch.nn.init.normal_(p, std=0.2)  # norms away from 1: their gradients matter
    tiled = BUILDERS[model](args, device="cpu")
    tiled.load_state_dict(plain.state_dict())
    for block in tiled.layers:
        block.tile(tiles)
    if head:
        tiled.tile_head(tiles)
    return plain, tiled


def _step(model, tokens, targets, chunk, rows) -> tuple[torch.Tensor, dict]:
    torch.manual_seed(7)  # the same dropout masks for both models
    loss = model(tokens, targets=targets, chunk_tokens=chunk, rows=rows)
    if loss.dim():  # the plain head on all rows: the logits (the final norm tiled there too)
        loss = next_token_loss_sum(loss, targets)
    # Rotary without a head norm is tiled by its own node (trainer/models/attention_tiles.py).
    model.tiled_calls = (_tiled_nodes(loss.grad_fn)
                         + _tiled_nodes(loss.grad_fn, "_RotationBackward"))
    loss.backward()
    return loss.detach(), {n: p.grad for n, p in model.named_parameters()}


def _tiled_nodes(root, node_name: str = "_TiledBackward") -> int:
    """How many backward nodes named `node_name` the graph under `root` holds."""
    seen, stack = set(), [root]
    while stack:
        node = stack.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        stack.extend(next_fn for next_fn, _ in node.next_functions)
    return sum(type(node).__name__ == node_name for node in seen)


def _relative(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).abs().max() / b.abs().max().clamp(min=1e-30)).item()


@pytest.mark.parametrize("chunk", [None, 16])
@pytest.mark.parametrize("gather", [False, True])
@pytest.mark.parametrize("tiles", [3, 5])
@pytest.mark.parametrize("model", sorted(BUILDERS))
def test_tiled_llama_equals_untiled_loss_and_every_gradient(chunk, gather, tiles, model) -> None:
    plain, tiled = _pair(tiles, model)
    generator = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, ARGS.vocab_size, (2, 24), generator=generator)
    targets = torch.randint(0, ARGS.vocab_size, (2, 24), generator=generator)
    if gather:
        targets[:, :14] = IGNORE_INDEX  # a prompt: 20 supervised rows, gathered (32 with pad)
    rows = supervised_rows(targets) if gather else None
    assert (rows is not None) == gather
    want_loss, want = _step(plain, tokens, targets, chunk, rows)
    got_loss, got = _step(tiled, tokens, targets, chunk, rows)
    # Both halves of each block, its keys' and (attention dropout on: whole attention) its
    # queries' rotary, and the final norm went through the tiles.
    assert tiled.tiled_calls == 4 * ARGS.n_layers + 1 and plain.tiled_calls == 0
    assert _relative(got_loss, want_loss) <= 1e-6
    assert got.keys() == want.keys() and all(g is not None for g in got.values())
    for name in want:
        assert _relative(got[name], want[name]) <= 1e-6, name
    assert not torch.equal(got["layers.0.attention_norm.weight"],
                           torch.zeros_like(got["layers.0.attention_norm.weight"]))


def test_one_tile_is_the_untiled_code_bit_for_bit_and_tiling_twice_is_refused() -> None:
    plain, tiled = _pair(1)
    tokens = torch.randint(0, ARGS.vocab_size, (1, 16))
    want_loss, want = _step(plain, tokens, tokens, 16, None)
    got_loss, got = _step(tiled, tokens, tokens, 16, None)
    assert torch.equal(got_loss, want_loss) and all(torch.equal(got[n], want[n]) for n in want)
    _, three = _pair(3)
    with pytest.raises(RuntimeError, match="already tiled"):
        three.layers[0].tile(2)
    with pytest.raises(ValueError, match="tiles must be >= 1"):
        plain.layers[0].tile(0)


def _block_peak(tiles: int) -> int:
    """Peak live tensor bytes of one long block's forward and backward."""
    args = LlamaArgs(dim=64, n_layers=1, n_heads=4, n_kv_heads=2, vocab_size=8, ffn_hidden=128,
                     max_seq_len=2048)
    block = build_llama(args, device="cpu").layers[0]
    block.tile(tiles)
    x = torch.randn(1, 2048, 64, requires_grad=True)
    rope = rope_cos_sin(args.head_dim, 2048, args.rope_theta, torch.device("cpu"))
    upstream = torch.randn(1, 2048, 64)
    with LiveTensorBytes(list(block.parameters()) + [x, upstream, *rope]) as live:
        block(x, rope).backward(upstream)
    return live.peak


def test_a_tiled_block_holds_fewer_token_tensors() -> None:
    untiled, tiled = _block_peak(1), _block_peak(8)
    # Untiled, the block's backward holds the MLP's [tokens, 128] intermediates and the norms'
    # and projections' [tokens, 64] ones at once; 8 tiles hold one tile's of each.
    assert tiled < 0.6 * untiled, (tiled, untiled)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("packed", [False, True])
def test_tiled_rotary_keeps_nothing_and_is_autograds_rotation_bit_for_bit(dtype, packed) -> None:
    """Rotary in tiles without a head norm (trainer/models/attention_tiles.py's _Rotation):
    nothing saved for backward (a view of the q/k/v projection would keep all of it), and the
    output and the gradient (the inverse rotation) equal autograd's apply_rope bit for bit."""
    from trainer.models.attention_tiles import rotated_in_tiles
    from trainer.models.rope import apply_rope, rope_at

    generator = torch.Generator().manual_seed(3)
    heads, head_dim, tokens = 2, 8, 12
    projection = torch.randn(2, tokens, 3 * heads * head_dim, generator=generator).to(dtype)
    if packed:
        rope = rope_at(torch.randint(0, 50, (2, tokens), generator=generator), head_dim, 1e4)
    else:
        rope = rope_cos_sin(head_dim, tokens, 1e4, torch.device("cpu"))
    grad = torch.randn(2, tokens, heads, head_dim, generator=generator).to(dtype)
    attention = torch.nn.Module()
    attention.head_dim = head_dim
    leaf = projection.clone().requires_grad_()
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        out = rotated_in_tiles(attention, "k_norm", leaf[..., :heads * head_dim], heads, rope, 5)
    assert saved == []
    out.backward(grad)
    plain = projection.clone().requires_grad_()
    want = apply_rope(plain[..., :heads * head_dim].view(2, tokens, heads, head_dim), rope)
    want.backward(grad)
    assert torch.equal(out, want) and torch.equal(leaf.grad, plain.grad)
