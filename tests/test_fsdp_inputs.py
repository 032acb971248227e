"""FSDP2 mixed precision casts a block's hidden state, not the other inputs it is called with
(issue 29, item 10): the rotary tables stay float32, as the plain reference keeps them."""

from __future__ import annotations

import torch
from torch import nn

from checkpointing.plan import make_plan
from sharding.fsdp import apply_fsdp, build_mesh, mixed_precision
from sharding.layout import mesh_layout

DIM, VOCAB = 8, 32


class RopeBlock(nn.Module):
    """Called as block(hidden, (cos, sin)), like the Llama blocks; records what it was given."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(DIM, DIM, bias=False)
        self.seen: list[tuple[torch.dtype, ...]] = []

    def forward(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        cos, sin = rope
        self.seen.append((x.dtype, cos.dtype, sin.dtype))
        return x + self.linear(x) * (cos + sin).mean().to(x.dtype)


class Model(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, DIM)
        self.layers = nn.ModuleList(RopeBlock() for _ in range(2))

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        # Upcast on purpose: the first block must still get its hidden state in param_dtype.
        hidden = self.embed(tokens).float()
        angles = torch.outer(torch.arange(tokens.shape[1], dtype=torch.float32),
                             torch.ones(DIM, dtype=torch.float32))
        rope = (torch.cos(angles), torch.sin(angles))
        for layer in self.layers:
            hidden = layer(hidden, rope)
        return hidden


def test_blocks_cast_their_hidden_state_and_keep_float32_rope(world_of_one) -> None:
    torch.manual_seed(0)
    model = Model()
    blocks = list(model.layers)
    plan = make_plan(["layers.0", "layers.1"], ["none", "none"], shard=True)
    apply_fsdp(model, blocks, plan, build_mesh(mesh_layout("fsdp", 1), "cpu"),
               mixed_precision("bfloat16", "float32"), reshard_after_forward=True)
    out = model(torch.randint(0, VOCAB, (2, 5)))
    out.float().square().mean().backward()
    assert all(p.grad is not None for p in model.parameters())
    for block in blocks:
        assert block.seen == [(torch.bfloat16, torch.float32, torch.float32)], block.seen
    assert out.dtype == torch.bfloat16
