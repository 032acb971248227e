"""Qwen3 (dense): the built-in Llama (trainer/models/llama.py) with each attention head's query
and key RMS-normalised over head_dim before rotary, as Qwen3 does in place of Qwen2's q/k/v bias.

What differs from Llama is only that: its blocks are Llama's blocks holding a `Qwen3Attention`
(Llama's attention plus `q_norm` and `k_norm`, one weight of head_dim each, shared by the heads);
the rest comes from its settings: one head's width (`head_dim`, which need not be
dim / n_heads: Qwen3-32B has dim 5120 and 64 heads of 128), a rotary base of 1e6, RMSNorm eps
1e-6, tied embeddings on the small models. Everything the trainer does to a Llama (recompute,
offload, sequence tiles, Ulysses, the chunked head, compile) reaches it through the same
modules, so parameter names are Llama's plus `layers.<i>.attention.{q,k}_norm.weight`.
"""

from __future__ import annotations

import re

import torch

from trainer.models import llama_counts
from trainer.models.llama import Attention, Block, Llama, LlamaArgs, RMSNorm

_HEAD_NORM = re.compile(r"layers\.(\d+)\.attention\.[qk]_norm\.weight")


class Qwen3Attention(Attention):
    def __init__(self, args: LlamaArgs) -> None:
        super().__init__(args)
        self.q_norm = RMSNorm(args.head_dim, args.norm_eps)
        self.k_norm = RMSNorm(args.head_dim, args.norm_eps)

    def norm_heads(self, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Each head of q and k ([B, T, heads, head_dim]) to unit RMS, times its weight."""
        return self.q_norm(q), self.k_norm(k)


class Qwen3Block(Block):
    attention_class = Qwen3Attention


class Qwen3(Llama):
    block_class = Qwen3Block

    def init_rule(self, name: str) -> tuple[tuple[int, ...], float | None]:
        """Llama's rules, and ones for the head norms (identity at start, as every norm)."""
        match = _HEAD_NORM.fullmatch(name)
        if match is not None and int(match.group(1)) < self.args.n_layers:
            return (self.args.head_dim,), None
        return super().init_rule(name)


def build_qwen3(args: LlamaArgs, device: torch.device | str = "meta") -> Qwen3:
    """A Qwen3 with its parameters allocated on ``device`` (meta: no memory)."""
    with torch.device(device):
        return Qwen3(args)


def count_params(args: LlamaArgs, exclude_embeddings: bool = False) -> int:
    """Llama's count and the two head norms of every layer."""
    return (llama_counts.count_params(args, exclude_embeddings)
            + 2 * args.n_layers * args.head_dim)


def flops_per_token(args: LlamaArgs, seq_len: int) -> float:
    """Llama's estimate (trainer/models/llama_counts.py) with the head norms' weights in N."""
    return llama_counts.flops_per_token(args, seq_len) + 6.0 * 2 * args.n_layers * args.head_dim
