"""Composing the model: build on meta, find blocks, plan, wrap per block, shard, materialise.

Nothing here is specific to Llama: the model contributes `init_param(name, full, generator)`
(optional: a generic fallback covers plain modules), and blocks come from `find_blocks`.
"""

from __future__ import annotations

import hashlib
from typing import Callable, Optional, Sequence

import torch
from torch import nn
from torch.distributed.tensor import DTensor, Shard

from checkpointing.blocks import canonical_name, find_blocks
from checkpointing.plan import BlockPlan
from launch.env import DistEnv
from sharding import fsdp
from trainer.config import ModelConfig, ShardingConfig
from trainer.model import LlamaArgs, build_llama


def llama_args(cfg: ModelConfig) -> LlamaArgs:
    return LlamaArgs(dim=cfg.dim, n_layers=cfg.n_layers, n_heads=cfg.n_heads,
                     n_kv_heads=cfg.n_kv_heads, vocab_size=cfg.vocab_size,
                     ffn_hidden=cfg.ffn_hidden, max_seq_len=cfg.max_seq_len,
                     norm_eps=cfg.norm_eps, rope_theta=cfg.rope_theta, dropout=cfg.dropout,
                     tie_embeddings=cfg.tie_embeddings)


def init_params(model: nn.Module, seed: int) -> None:
    """Initialise an unsharded, materialised model exactly as `materialize` would."""
    materialize(model, next(model.parameters()).device, seed, allocate=False)


def build_llama_on_meta(cfg: ModelConfig) -> nn.Module:
    return build_llama(llama_args(cfg), device="meta")


def default_init(name: str, full: torch.Tensor, generator: torch.Generator) -> None:
    """For models without `init_param`: N(0, 0.02) matrices, unit norms/scales, zero biases."""
    if full.ndim >= 2:
        full.normal_(0.0, 0.02, generator=generator)
    elif name.endswith("bias"):
        full.zero_()
    else:
        full.fill_(1.0)


def param_seed(seed: int, name: str) -> int:
    """Per-parameter seed, the same on every rank and process (Python's hash() is salted)."""
    digest = hashlib.blake2b(f"{seed}/{name}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & (2**63 - 1)


def _local_part(full: torch.Tensor, param: DTensor) -> torch.Tensor:
    """This rank's piece of `full` under the param's placements (torch.chunk semantics, as FSDP2)."""
    piece = full
    coords = param.device_mesh.get_coordinate()
    for mesh_dim, placement in enumerate(param.placements):
        if isinstance(placement, Shard):
            chunks = torch.chunk(piece, param.device_mesh.size(mesh_dim), dim=placement.dim)
            index = coords[mesh_dim]
            piece = chunks[index] if index < len(chunks) else piece.narrow(placement.dim, 0, 0)
    return piece


@torch.no_grad()
def materialize(model: nn.Module, device: torch.device, seed: int, allocate: bool = True) -> None:
    """Allocate real storage and initialise every parameter identically for any world size.

    Each parameter's full value comes from its own generator seeded by (seed, name); a rank
    keeps only its shard. So the weights do not depend on how many ranks share them.
    """
    init_fn: Callable = getattr(model, "init_param", None) or default_init
    if allocate:
        model.to_empty(device=device)
    seen: set[int] = set()
    for name, param in model.named_parameters():
        if id(param) in seen:  # tied weights are initialised once, under their first name
            continue
        seen.add(id(param))
        clean = canonical_name(name)
        generator = torch.Generator(device=device).manual_seed(param_seed(seed, clean))
        full = torch.empty(param.shape, dtype=param.dtype, device=device)
        init_fn(clean, full, generator)
        if isinstance(param, DTensor):
            param.to_local().copy_(_local_part(full, param))
        else:
            param.copy_(full)
    if hasattr(model, "reset_buffers"):
        model.reset_buffers()


def shard_model(model: nn.Module, blocks: Sequence[nn.Module], plan: Sequence[BlockPlan],
                cfg: ShardingConfig, denv: DistEnv, replicate: int) -> tuple[nn.Module, object]:
    """Applies the sharding part of the plan; returns (model to train, mesh or None)."""
    mesh = fsdp.build_mesh(cfg.mode, denv.device.type, denv.world_size, replicate)
    if mesh is not None:
        fsdp.apply_fsdp(model, blocks, plan, mesh, fsdp.mixed_precision(cfg.param_dtype,
                        cfg.reduce_dtype), cfg.reshard_after_forward)
    return model, mesh


def find_model_blocks(model: nn.Module, pattern: Optional[str]) -> tuple[list[str], list[nn.Module]]:
    found = find_blocks(model, pattern)
    return [name for name, _ in found], [module for _, module in found]
