"""Blocks are found for any model; the same plan shards a non-Llama model; init ignores sharding."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch import nn

from checkpointing.blocks import find_blocks
from checkpointing.plan import make_plan
from tests.dist import spawn
from tests.helpers import config
from trainer.build import build_on_meta, materialize
from sharding.fsdp import apply_fsdp, build_mesh, mixed_precision
from sharding.layout import mesh_layout


class MixerLayer(nn.Module):
    """Not a transformer block: token-mixing then channel-mixing MLPs with a LayerNorm."""

    def __init__(self, tokens: int, width: int, dropout: float):
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.token_mix = nn.Linear(tokens, tokens)
        self.channel_mix = nn.Sequential(nn.Linear(width, 2 * width), nn.GELU(),
                                         nn.Linear(2 * width, width))
        self.drop = nn.Dropout(dropout)

    def forward(self, x):  # [B, tokens, width]
        x = x + self.drop(self.token_mix(self.norm(x).transpose(1, 2)).transpose(1, 2))
        return x + self.drop(self.channel_mix(self.norm(x)))


class ToyMixer(nn.Module):
    def __init__(self, tokens: int = 8, width: int = 16, depth: int = 3, dropout: float = 0.0):
        super().__init__()
        self.stem = nn.Linear(4, width)
        self.stages = nn.Sequential(*[MixerLayer(tokens, width, dropout) for _ in range(depth)])
        self.head = nn.Linear(width, 3)

    def forward(self, x):
        return self.head(self.stages(self.stem(x)).mean(dim=1))


def test_find_blocks_default_and_pattern() -> None:
    toy = ToyMixer()
    found = find_blocks(toy)
    assert [name for name, _ in found] == ["stages.0", "stages.1", "stages.2"]
    assert all(isinstance(m, MixerLayer) for _, m in found)
    # The largest repeated container wins over smaller ones (the MLP inside each layer).
    assert [n for n, _ in find_blocks(toy, "stages.*")] == ["stages.0", "stages.1", "stages.2"]
    llama = build_on_meta(config().model)
    assert [n for n, _ in find_blocks(llama)] == [f"layers.{i}" for i in range(4)]
    with pytest.raises(ValueError, match="model.block_pattern"):
        find_blocks(toy, "decoder.*")
    with pytest.raises(ValueError, match="model.block_pattern"):
        find_blocks(nn.Linear(2, 2))


def _toy_step(model: nn.Module) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(6, 8, 4, generator=generator)
    y = torch.randint(0, 3, (6,), generator=generator)
    loss = nn.functional.cross_entropy(model(x), y)
    loss.backward()
    grads = {}
    for name, p in model.named_parameters():
        g = p.grad
        grads[name] = g.full_tensor() if hasattr(g, "full_tensor") else g
    return loss.detach(), grads


def _sharded_toy(rank: int, world_size: int):
    with torch.device("meta"):
        model = ToyMixer()
    names = [n for n, _ in find_blocks(model)]
    blocks = [m for _, m in find_blocks(model)]
    plan = make_plan(names, ["none"] * len(names), shard=True)
    mesh = build_mesh(mesh_layout("fsdp", world_size), "cpu")
    apply_fsdp(model, blocks, plan, mesh, mixed_precision(None, None), True)
    materialize(model, torch.device("cpu"), seed=3)
    loss, grads = _toy_step(model)
    sharded = sum(hasattr(p, "placements") for p in model.parameters())
    return loss, grads, sharded


def test_non_llama_model_is_sharded_per_block_and_matches_single_process() -> None:
    with torch.device("meta"):
        reference = ToyMixer()
    materialize(reference, torch.device("cpu"), seed=3)
    ref_loss, ref_grads = _toy_step(reference)
    results = spawn(_sharded_toy, 2)
    for loss, grads, sharded in results:
        assert sharded == len(list(reference.parameters()))
        torch.testing.assert_close(loss, ref_loss, rtol=1e-5, atol=1e-6)
        assert grads.keys() == ref_grads.keys()
        for name in grads:
            torch.testing.assert_close(grads[name], ref_grads[name], rtol=1e-5, atol=1e-6)


def _llama_full_weights(rank: int, world_size: int, mode: str):
    cfg = config("model.tie_embeddings=true")
    model = build_on_meta(cfg.model)
    found = find_blocks(model)
    mesh = build_mesh(mesh_layout(mode, world_size, 2 if mode == "hsdp" else None), "cpu")
    apply_fsdp(model, [m for _, m in found], make_plan([n for n, _ in found], ["none"] * len(found), True),
               mesh, mixed_precision(None, None), True)
    materialize(model, torch.device("cpu"), seed=0)
    out = {n: p.full_tensor() for n, p in model.named_parameters()}
    dist.barrier()
    return out


@pytest.mark.parametrize("mode", ["fsdp", "hsdp"])
def test_initial_weights_do_not_depend_on_world_size(mode) -> None:
    cfg = config("model.tie_embeddings=true")
    model = build_on_meta(cfg.model)
    materialize(model, torch.device("cpu"), seed=0)
    expected = dict(model.named_parameters())
    assert model.output.weight is model.tok_embeddings.weight
    for weights in spawn(_llama_full_weights, 2, mode):
        assert weights.keys() == expected.keys()
        for name, value in weights.items():
            assert torch.equal(value, expected[name]), name
