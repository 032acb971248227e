"""AdamW, warmup + cosine learning rate, and gradient clipping that is right for sharded grads."""

from __future__ import annotations

import math
from typing import Iterable

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from trainer.config import OptimConfig


def build_optimizer(model: nn.Module, cfg: OptimConfig) -> torch.optim.AdamW:
    # No weight decay on vectors (norm scales, biases): decaying them only hurts.
    decay, no_decay = [], []
    for param in model.parameters():
        if param.requires_grad:
            (decay if param.ndim >= 2 else no_decay).append(param)
    groups = [{"params": decay, "weight_decay": cfg.weight_decay},
              {"params": no_decay, "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=cfg.lr, betas=(cfg.beta1, cfg.beta2), eps=cfg.eps)


def lr_at(step: int, cfg: OptimConfig, total_steps: int) -> float:
    """Linear warmup over optim.warmup_steps, then cosine decay to lr * min_lr_ratio."""
    warmup = min(cfg.warmup_steps, total_steps)
    if step < warmup:
        return cfg.lr * (step + 1) / warmup
    progress = (step - warmup) / max(1, total_steps - warmup)
    cosine = 0.5 * (1.0 + math.cos(math.pi * min(1.0, progress)))
    return cfg.lr * (cfg.min_lr_ratio + (1.0 - cfg.min_lr_ratio) * cosine)


def build_scheduler(optimizer: torch.optim.Optimizer, cfg: OptimConfig,
                    total_steps: int) -> torch.optim.lr_scheduler.LambdaLR:
    return torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda step: lr_at(step, cfg, total_steps) / cfg.lr)


@torch.no_grad()
def clip_grad_norm(params: Iterable[nn.Parameter], max_norm: float) -> torch.Tensor:
    """Global L2 norm of all gradients (then clipped to max_norm when > 0), as a plain tensor.

    With FSDP the gradients are DTensor shards; their norm is a partial result that
    `full_tensor()` reduces over the mesh, so every rank sees the norm of the whole model.
    """
    with_grad = [p for p in params if p.grad is not None]
    norm = torch.nn.utils.get_total_norm([p.grad for p in with_grad], norm_type=2.0, foreach=True)
    if isinstance(norm, DTensor):
        norm = norm.full_tensor()
    if max_norm > 0:
        torch.nn.utils.clip_grads_with_norm_(with_grad, max_norm, norm, foreach=True)
    return norm
