"""A Vision Transformer for image classification (`model.arch=vit`), written for high resolutions.

Images are cut into patch_size x patch_size patches (a strided convolution), a class token is
prepended, learned position embeddings are added, and pre-norm encoder blocks follow; the class
token's final state is classified. At 1024x1024 with 16-pixel patches a sequence is 4096 tokens,
so activations, not parameters, are what fills memory: the case the per-block plan is for.

Attention probabilities are not dropped: dropout there would force SDPA onto its path that keeps
the T x T matrix. `dropout` applies to the residual branches and the embeddings, as in ViT.
"""

from __future__ import annotations

import logging
import re
from dataclasses import dataclass
from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

from trainer.models.weights import SafetensorsReader

log = logging.getLogger("trainer")

@dataclass(frozen=True)
class ViTArgs:
    image_size: int = 224
    patch_size: int = 16
    channels: int = 3
    num_classes: int = 10
    dim: int = 192
    n_layers: int = 12
    n_heads: int = 3
    ffn_hidden: int = 768
    norm_eps: float = 1e-6
    dropout: float = 0.0

    def __post_init__(self) -> None:
        if self.image_size % self.patch_size:
            raise ValueError(f"model.image_size={self.image_size} is not a multiple of "
                             f"model.patch_size={self.patch_size}")
        if self.dim % self.n_heads:
            raise ValueError(f"model.n_heads={self.n_heads} must divide model.dim={self.dim}")

    @property
    def num_patches(self) -> int:
        return (self.image_size // self.patch_size) ** 2


class SelfAttention(nn.Module):
    def __init__(self, dim: int, n_heads: int) -> None:
        super().__init__()
        self.n_heads = n_heads
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)
        # What attends over q, k, v: the hook sequence parallelism wraps
        # (trainer/models/attention.py).
        self.attend = F.scaled_dot_product_attention

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, tokens, dim = x.shape
        qkv = self.qkv(x).view(batch, tokens, 3, self.n_heads, dim // self.n_heads)
        q, k, v = qkv.permute(2, 0, 3, 1, 4).unbind(0)  # each [B, heads, T, head_dim]
        out = self.attend(q, k, v)
        return self.proj(out.transpose(1, 2).reshape(batch, tokens, dim))


class EncoderBlock(nn.Module):
    """Pre-norm encoder block, called as ``block(hidden)``."""

    def __init__(self, args: ViTArgs) -> None:
        super().__init__()
        self.norm1 = nn.LayerNorm(args.dim, eps=args.norm_eps)
        self.attention = SelfAttention(args.dim, args.n_heads)
        self.norm2 = nn.LayerNorm(args.dim, eps=args.norm_eps)
        self.fc1 = nn.Linear(args.dim, args.ffn_hidden)
        self.fc2 = nn.Linear(args.ffn_hidden, args.dim)
        self.dropout = nn.Dropout(args.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x + self.dropout(self.attention(self.norm1(x)))
        return h + self.dropout(self.fc2(F.gelu(self.fc1(self.norm2(h)))))


_BLOCK_PARAM = re.compile(r"blocks\.\d+\.")


class ViT(nn.Module):
    def __init__(self, args: ViTArgs) -> None:
        super().__init__()
        self.args = args
        self.patch_embed = nn.Conv2d(args.channels, args.dim, kernel_size=args.patch_size,
                                     stride=args.patch_size)
        self.cls_token = nn.Parameter(torch.empty(1, 1, args.dim))
        self.pos_embed = nn.Parameter(torch.empty(1, args.num_patches + 1, args.dim))
        self.embed_dropout = nn.Dropout(args.dropout)
        self.blocks = nn.ModuleList(EncoderBlock(args) for _ in range(args.n_layers))
        self.norm = nn.LayerNorm(args.dim, eps=args.norm_eps)
        self.head = nn.Linear(args.dim, args.num_classes)
        self.pretrained: Optional[SafetensorsReader] = None  # set by build_vit(path=...)

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        a = self.args
        expected = (a.channels, a.image_size, a.image_size)
        if images.dim() != 4 or tuple(images.shape[1:]) != expected:
            raise ValueError(f"images must be [batch, {a.channels}, {a.image_size}, "
                             f"{a.image_size}] (model.channels, model.image_size), got "
                             f"{tuple(images.shape)}")
        patches = self.patch_embed(images).flatten(2).transpose(1, 2)  # [B, T, dim]
        cls = self.cls_token.expand(patches.shape[0], -1, -1)
        hidden = self.embed_dropout(torch.cat([cls, patches], dim=1) + self.pos_embed)
        for block in self.blocks:
            hidden = block(hidden)
        return self.head(self.norm(hidden[:, 0]))  # [B, num_classes]

    @torch.no_grad()
    def init_param(self, name: str, full: torch.Tensor, generator: torch.Generator) -> None:
        """Fill the full (unsharded) tensor of parameter ``name`` in place.

        From pretrained weights when given: position embeddings of another grid are resized
        (fine-tuning at a higher resolution than pretraining), and a head for another number of
        classes starts afresh. Otherwise truncated N(0, 0.02) for matrices, the patch
        projection, the class token and positions; zero biases; unit norm scales.
        """
        if self.pretrained is not None:
            saved = self.pretrained.raw(name)
            if name == "pos_embed" and saved.shape != full.shape:
                full.copy_(resize_positions(saved, self.args.image_size // self.args.patch_size))
                return
            if not (name.startswith("head.") and saved.shape != full.shape):
                full.copy_(self.pretrained.get(name, full.shape))
                return
            if name == "head.weight":
                log.info(f"model.path: the pretrained head has {saved.shape[0]} classes, "
                         f"model.num_classes={full.shape[0]}: the head starts from scratch")
        leaf = _BLOCK_PARAM.sub("", name)
        if leaf.endswith("bias"):
            full.zero_()
        elif leaf.startswith("norm") and leaf.endswith("weight"):
            full.fill_(1.0)
        else:
            nn.init.trunc_normal_(full, mean=0.0, std=0.02, a=-0.04, b=0.04, generator=generator)

    def flops_per_token(self, tokens: int) -> float:
        """Training FLOPs per patch token (forward + backward): 6 x the matmul parameters each
        token passes through, plus non-causal attention (12 x layers x dim x tokens)."""
        a = self.args
        per_block = 4 * a.dim * a.dim + 2 * a.dim * a.ffn_hidden
        patch = a.channels * a.patch_size ** 2 * a.dim
        matmul = a.n_layers * per_block + patch
        return float(6 * matmul + 12 * a.n_layers * a.dim * (tokens + 1))


def resize_positions(saved: torch.Tensor, grid: int) -> torch.Tensor:
    """[1, 1 + g*g, dim] position embeddings for a grid x grid patch grid: the class token's
    row is kept, the patch rows are resized bicubically as the 2-D grid they are."""
    cls, patches = saved[:, :1], saved[:, 1:]
    old = round(patches.shape[1] ** 0.5)
    if old * old != patches.shape[1]:
        raise ValueError(f"model.path: pos_embed has {patches.shape[1]} patch rows, not a square "
                         "grid")
    square = patches.reshape(1, old, old, -1).permute(0, 3, 1, 2).float()
    resized = F.interpolate(square, size=(grid, grid), mode="bicubic", align_corners=False)
    return torch.cat([cls, resized.permute(0, 2, 3, 1).reshape(1, grid * grid, -1)
                      .to(saved.dtype)], dim=1)


def class_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Cross entropy of [B, classes] logits, in fp32 whatever their dtype."""
    return F.cross_entropy(logits.float(), labels)


def classification_loss(model: nn.Module, images: torch.Tensor,
                        labels: torch.Tensor) -> torch.Tensor:
    return class_loss(model(images), labels)


def build_vit(args: ViTArgs, device: torch.device | str = "meta",
              path: Optional[str] = None) -> ViT:
    """A ViT on `device`; with `path` (a `python -m trainer.export` folder of a ViT run) its
    init_param loads those weights."""
    with torch.device(device):
        model = ViT(args)
    if path is not None:
        model.pretrained = SafetensorsReader(path)
    return model
