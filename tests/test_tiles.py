"""Sequence tiles (checkpointing/tiles.py): a tiled MLP gives the untiled outputs and gradients,
dropout masks survive the recompute, the whole [tokens, hidden] intermediate never exists, and
the MLP's closed-form backward peak (below: the planner and the report trace the tiled code on
meta instead) holds on CPU; FSDP2 and DDP get the same gradients.
"""

from __future__ import annotations

import weakref
from contextlib import nullcontext
from typing import Optional

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from checkpointing.tiles import tile_module, tile_sizes, tiled
from tests.dist import spawn

DIM, HIDDEN = 8, 64

# An MLP's backward in numbers, the closed form this file holds to CPU. The [tokens, hidden]
# tensors alive at the peak of its recompute-and-backward (torch 2.13, CPU, fp32 and bf16):
#   gated (SwiGLU, w2(act(w1 x) * w3 x)): six: w1 x, w3 x, act(w1 x) and their product, saved
#     by the recompute, with the gradients of the product and of one factor.
#   plain (w2(act(w1 x))): three: w1 x and act(w1 x), saved, with the gradient of the second.
HIDDEN_COPIES = {"gated": 6, "plain": 3}
WEIGHTS = {"gated": 3, "plain": 2}  # [dim, hidden] weight matrices


def mlp_backward_peak_bytes(batch: int, seq_len: int, dim: int, hidden: int, itemsize: int,
                            tiles: int = 1, kind: str = "gated",
                            grad_itemsize: Optional[int] = None) -> int:
    """Peak bytes an MLP's backward adds to what exists before it (its saved input, the output
    gradient, the weights) when it keeps only its input and recomputes; as measured on CPU
    below, where tokens far outnumber `dim` (the long sequences tiles are for).

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


class MLP(nn.Module):
    """trainer/models/llama.py's SwiGLU FeedForward (gated) or w2(silu(w1 x)), with dropout on
    the hidden activations so that tiles must replay their random masks."""

    def __init__(self, gated: bool = True, dropout: float = 0.0) -> None:
        super().__init__()
        self.w1 = nn.Linear(DIM, HIDDEN, bias=False)
        self.w3 = nn.Linear(DIM, HIDDEN, bias=False) if gated else None
        self.w2 = nn.Linear(HIDDEN, DIM, bias=False)
        self.dropout = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        hidden = F.silu(self.w1(x))
        if self.w3 is not None:
            hidden = hidden * self.w3(x)
        return self.w2(self.dropout(hidden))


class LiveBytes(TorchDispatchMode):
    """Bytes of the storages created under it that are still alive, their peak, and the largest
    tensor any op returned: CPU memory accounting without an allocator to ask."""

    def __init__(self) -> None:
        super().__init__()
        self.live = self.peak = self.largest = 0
        self.alive: set[int] = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        inputs = {id(t.untyped_storage()) for t in tree_leaves((args, kwargs))
                  if isinstance(t, torch.Tensor)}
        for tensor in (t for t in tree_leaves(out) if isinstance(t, torch.Tensor)):
            self.largest = max(self.largest, tensor.numel())
            storage = tensor.untyped_storage()  # one Python object per storage while it lives
            key = id(storage)
            if key not in self.alive and key not in inputs:  # new memory, not a view
                self.alive.add(key)
                self.live += storage.nbytes()
                self.peak = max(self.peak, self.live)
                weakref.finalize(storage, self._free, key, storage.nbytes())
        return out

    def _free(self, key: int, nbytes: int) -> None:
        self.alive.discard(key)
        self.live -= nbytes


def _inputs(batch: int, seq: int, dtype=torch.float32, seed: int = 0):
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(batch, seq, DIM, generator=generator, dtype=dtype)
    return x, torch.randn(batch, seq, DIM, generator=generator, dtype=dtype)


def _grads(mlp: nn.Module, x: torch.Tensor, upstream: torch.Tensor, run) -> list[torch.Tensor]:
    mlp.zero_grad(set_to_none=True)
    x = x.clone().requires_grad_()
    out = run(mlp, x)
    out.backward(upstream)
    return [out.detach(), x.grad, *(p.grad for p in mlp.parameters())]


def _relative(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).abs().max() / b.abs().max()).item()


def _tiled(tiles: int):
    return lambda mlp, x: tiled(mlp, x, tiles, list(mlp.parameters()))


def _per_tile_reference(tiles: int):
    """Plain autograd over the same tiles: the same random draws in the same order."""
    def run(mlp, x):
        return torch.cat([mlp(t) for t in x.split(tile_sizes(x.shape[1], tiles), dim=1)], dim=1)
    return run


@pytest.mark.parametrize("gated", [True, False])
@pytest.mark.parametrize("tiles,seq", [(2, 16), (3, 10), (4, 16)])  # 10 = 4 + 3 + 3 tokens
def test_tiled_equals_untiled(gated, tiles, seq) -> None:
    mlp = MLP(gated)
    x, upstream = _inputs(2, seq)
    expected = _grads(mlp, x, upstream, lambda m, t: m(t))
    got = _grads(mlp, x, upstream, _tiled(tiles))
    for a, b in zip(got, expected, strict=True):
        assert a.shape == b.shape and _relative(a, b) <= 1e-6


@pytest.mark.parametrize("tiles", [2, 3])
def test_dropout_masks_of_the_recompute_are_those_of_the_forward(tiles, monkeypatch) -> None:
    """Against plain autograd over the same tiles from the same seed: outputs and the input
    gradient bitwise (each tile is the same arithmetic), weight gradients bitwise for two tiles
    (a + b == b + a) and within 1e-6 for three (summed in another order). A recompute drawing
    fresh masks would be off by far more."""
    mlp = MLP(dropout=0.5)
    x, upstream = _inputs(2, 12)
    torch.manual_seed(1)
    expected = _grads(mlp, x, upstream, _per_tile_reference(tiles))
    torch.manual_seed(1)
    got = _grads(mlp, x, upstream, _tiled(tiles))
    assert torch.equal(got[0], expected[0]) and torch.equal(got[1], expected[1])
    for a, b in zip(got[2:], expected[2:], strict=True):
        assert torch.equal(a, b) if tiles == 2 else _relative(a, b) <= 1e-6
    # The control: recomputing without the recorded random states draws other masks.
    monkeypatch.setattr("checkpointing.tiles._restored_rng", lambda state, device: nullcontext())
    torch.manual_seed(1)
    unrestored = _grads(mlp, x, upstream, _tiled(tiles))
    assert torch.equal(unrestored[0], got[0]) and _relative(unrestored[1], got[1]) > 0.1


def test_backward_leaves_the_random_state_as_it_found_it() -> None:
    mlp = MLP(dropout=0.5)
    x, upstream = _inputs(1, 8)
    out = tiled(mlp, x.requires_grad_(), 2, list(mlp.parameters()))
    before = torch.get_rng_state()
    out.backward(upstream)
    assert torch.equal(torch.get_rng_state(), before)


@pytest.mark.parametrize("gated", [True, False])
@pytest.mark.parametrize("batch,seq,tiles", [(2, 256, 2), (2, 256, 3), (1, 300, 7)])
def test_the_whole_intermediate_never_exists_and_the_peak_is_predicted(gated, batch, seq,
                                                                       tiles) -> None:
    mlp = MLP(gated)
    x, upstream = _inputs(batch, seq)
    peaks = {}
    for n in (1, tiles):
        out = tiled(mlp, x.clone().requires_grad_(), n, list(mlp.parameters()))
        with LiveBytes() as meter:
            out.backward(upstream)
        kind = "gated" if gated else "plain"
        predicted = mlp_backward_peak_bytes(batch, seq, DIM, HIDDEN, 4, n, kind)
        assert meter.peak <= predicted <= 1.03 * meter.peak, (n, meter.peak, predicted)
        longest = batch * max(tile_sizes(seq, n))
        assert meter.largest == longest * HIDDEN  # the largest tensor: one tile's [tokens, hidden]
        peaks[n] = meter.peak
    assert peaks[tiles] < 0.65 * peaks[1]


def test_tile_module_keeps_names_and_refuses_what_it_cannot_do() -> None:
    mlp = MLP()
    names = [n for n, _ in mlp.named_parameters()]
    x, upstream = _inputs(2, 6)
    expected = _grads(mlp, x, upstream, lambda m, t: m(t))
    assert tile_module(mlp, 3) is mlp
    assert [n for n, _ in mlp.named_parameters()] == names
    got = _grads(mlp, x, upstream, lambda m, t: m(t))
    assert all(_relative(a, b) <= 1e-6 for a, b in zip(got, expected))
    with pytest.raises(RuntimeError, match="already tiled"):
        tile_module(mlp, 2)
    with pytest.raises(ValueError, match="7 tiles for 6 tokens"):
        tile_module(MLP(), 7)(x)
    with pytest.raises(ValueError, match="tiles must be >= 1, got 0"):
        tile_module(MLP(), 0)
    plain = MLP()
    assert tile_module(plain, 1).forward.__func__ is MLP.forward  # one tile: untouched


def test_frozen_input_and_frozen_weights_get_no_gradient() -> None:
    mlp = MLP()
    mlp.w2.weight.requires_grad_(False)
    x, upstream = _inputs(2, 8)
    tiled(mlp, x, 2, [p for p in mlp.parameters() if p.requires_grad]).backward(upstream)
    reference = MLP()
    reference.load_state_dict(mlp.state_dict())
    reference(x).backward(upstream)
    assert mlp.w2.weight.grad is None and x.grad is None
    assert _relative(mlp.w1.weight.grad, reference.w1.weight.grad) <= 1e-6


def test_bf16_gradients_are_summed_in_float32_and_returned_in_bf16() -> None:
    mlp = MLP().to(torch.bfloat16)
    x, upstream = _inputs(1, 64, torch.bfloat16)
    tiled(mlp, x, 8, list(mlp.parameters())).backward(upstream)
    reference = MLP()
    reference.load_state_dict(mlp.state_dict())
    reference(x.float()).backward(upstream.float())
    for p, r in zip(mlp.parameters(), reference.parameters()):
        assert p.grad.dtype == torch.bfloat16 and _relative(p.grad.float(), r.grad) < 1e-2


def test_parameters_the_recompute_does_not_use_are_an_error() -> None:
    mlp, stranger = MLP(), nn.Parameter(torch.ones(3))
    x, upstream = _inputs(1, 4)
    out = tiled(mlp, x.requires_grad_(), 2, [stranger])  # as if FSDP had swapped them
    with pytest.raises(RuntimeError, match="used none of the parameters"):
        out.sum().backward()


# --- sharded parameters: FSDP2 (and DDP) on 2 gloo ranks ----------------------------------

class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(DIM)
        self.mlp = MLP()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.mlp(self.norm(x))


def _sharded_step(rank: int, variant: str) -> dict[str, torch.Tensor]:
    from torch.distributed.fsdp import fully_shard
    from torch.nn.parallel import DistributedDataParallel

    from checkpointing.wrap import checkpoint_block

    torch.manual_seed(0)
    model = nn.Sequential(Block(), Block())
    for block in model:
        if "tiled" in variant:
            tile_module(block.mlp, 3)
        if "recompute" in variant:
            checkpoint_block(block, "full")
        if "ddp" not in variant:
            fully_shard(block, reshard_after_forward=True)  # freed after forward, refilled
    model = DistributedDataParallel(model) if "ddp" in variant else fully_shard(model)
    x, upstream = _inputs(2, 10, seed=rank)  # each rank its own data: the reduction matters
    model(x.requires_grad_()).backward(upstream)
    grads = {name: p.grad for name, p in model.named_parameters()}
    return {name: getattr(g, "full_tensor", lambda g=g: g)() for name, g in grads.items()}


def _sharded_variants(rank: int, world: int) -> dict[str, dict[str, torch.Tensor]]:
    return {v: _sharded_step(rank, v) for v in ("fsdp", "fsdp tiled", "fsdp tiled recompute",
                                                 "ddp", "ddp tiled")}


def test_fsdp2_and_ddp_parameters_get_the_untiled_gradients() -> None:
    for result in spawn(_sharded_variants, 2):
        for variant, grads in result.items():
            plain = result[variant.split()[0]]
            assert grads.keys() == plain.keys() and len(grads) == 10
            for name, grad in grads.items():
                assert _relative(grad, plain[name]) <= 1e-6, (variant, name)
        ddp = {name.removeprefix("module."): grad for name, grad in result["ddp"].items()}
        assert all(_relative(result["fsdp"][name], grad) <= 1e-6 for name, grad in ddp.items())


def test_under_torch_compile_the_tiles_draw_eager_masks_forward_and_backward() -> None:
    """A compiled forward draws dropout masks from inductor's generator, an eager recompute
    from eager's: tiles run eagerly in both, so the compiled block's gradients are the eager
    ones (0.1 to 1 apart otherwise)."""
    torch.manual_seed(0)
    blocks = [Block(), Block()]
    blocks[1].load_state_dict(blocks[0].state_dict())
    for block in blocks:
        block.mlp.dropout.p = 0.5
        tile_module(block.mlp, 3)
    x, upstream = _inputs(2, 12)
    results = []
    for run in (torch.compile(blocks[0]), blocks[1]):
        torch.manual_seed(5)
        results.append(_grads(run, x, upstream, lambda m, t: m(t)))
    for a, b in zip(*results, strict=True):
        assert _relative(a, b) <= 1e-5
