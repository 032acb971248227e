"""The built-in Vision Transformer (`model.arch=vit`, trainer/models/vit.py): image
classification, its shapes the model.* fields; model.path may name a `python -m trainer.export`
folder of a ViT to fine-tune."""

from __future__ import annotations

import json
import os
from typing import TYPE_CHECKING

from trainer.config import ModelConfig, require
from trainer.models.families.base import ImageClassifier

if TYPE_CHECKING:
    from torch import nn


class ViT(ImageClassifier):
    arch = "vit"

    def validate(self, m: ModelConfig, seq_len: int) -> None:
        super().validate(m, seq_len)
        require(m.dim % m.n_heads == 0, "model.n_heads",
                f"must divide model.dim={m.dim}, got {m.n_heads}")
        require(m.hf_config is None, "model.hf_config", "only applies to model.arch=hf")
        if m.path is not None:
            self._check_pretrained(m)

    def _check_pretrained(self, m: ModelConfig) -> None:
        """model.path: a `python -m trainer.export` folder of a ViT of the same shape (the image
        size and number of classes may differ: positions are resized, the head replaced)."""
        meta = os.path.join(m.path, "config.json")
        require(os.path.isfile(meta), "model.path",
                f"{m.path} has no config.json (a folder written by python -m trainer.export from "
                "a model=vit run)")
        with open(meta) as f:
            saved = json.load(f).get("model", {})
        require(saved.get("arch") == self.arch, "model.path",
                f"{m.path} holds a model.arch={saved.get('arch')} model, not a ViT")
        for key in ("dim", "n_layers", "n_heads", "ffn_hidden", "patch_size", "channels"):
            require(saved.get(key) == getattr(m, key), f"model.{key}",
                    f"{getattr(m, key)}, but the pretrained model in {m.path} has "
                    f"{saved.get(key)}; set model.{key}={saved.get(key)}")

    def build_on_meta(self, m: ModelConfig) -> nn.Module:
        from trainer.models.vit import ViTArgs, build_vit

        args = ViTArgs(image_size=m.image_size, patch_size=m.patch_size, channels=m.channels,
                       num_classes=m.num_classes, dim=m.dim, n_layers=m.n_layers,
                       n_heads=m.n_heads, ffn_hidden=m.ffn_hidden, norm_eps=m.norm_eps,
                       dropout=m.dropout)
        return build_vit(args, device="meta", path=m.path)

    def attention_modules(self, model: nn.Module) -> list[nn.Module]:
        from trainer.models.vit import SelfAttention

        return [module for module in model.modules() if isinstance(module, SelfAttention)]


FAMILY = ViT()
