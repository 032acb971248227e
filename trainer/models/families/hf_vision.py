"""Hugging Face image classifiers (`model.arch=hf_vision`, trainer/models/hf_vision.py): any
AutoModelForImageClassification from a local pretrained folder or model.hf_config, at
model.image_size and model.num_classes; its attention goes through transformers' attention
registry, as for model.arch=hf."""

from __future__ import annotations

from typing import TYPE_CHECKING, Callable, Mapping, Optional

from trainer.config import ModelConfig, require
from trainer.models.families.base import ImageClassifier
from trainer.models.hf_settings import check_hf_source, hf_fields

if TYPE_CHECKING:
    import torch
    from torch import nn


class HFVision(ImageClassifier):
    arch = "hf_vision"

    def validate(self, m: ModelConfig, seq_len: int) -> None:
        super().validate(m, seq_len)
        check_hf_source(m)
        patch = int(hf_fields(m).get("patch_size", 16))
        require(m.patch_size == patch, "model.patch_size",
                f"must be the model's own patch size {patch}, got {m.patch_size}")

    def build_on_meta(self, m: ModelConfig) -> nn.Module:
        from trainer.models.hf_vision import build_hf_vision_on_meta

        return build_hf_vision_on_meta(m.hf_config, m.path, m.image_size, m.num_classes,
                                       m.channels, m.dropout, m.attn_implementation)

    def attention_modules(self, model: nn.Module) -> list[nn.Module]:
        from trainer.models.hf import hf_attention_modules

        return hf_attention_modules(model.hf)

    def wrap_attention(self, model: nn.Module, wrap: Callable) -> int:
        from trainer.models.hf import wrap_hf_attention

        return wrap_hf_attention(model.hf, wrap)

    def image_preprocessing(self, m: ModelConfig) -> Optional[dict]:
        """The pretrained folder's own mean, std and resampling (preprocessor_config.json)."""
        from trainer.models.hf_vision import preprocessing

        return preprocessing(m.path)

    def export(self, tensors: Mapping[str, torch.Tensor], model: Mapping, out: str, step: int,
               checkpoint: str) -> str:
        """A folder `from_pretrained` loads, at the resolution and classes it was tuned at."""
        from trainer.models.hf import save_pretrained

        classes = int(model["num_classes"])
        fields = {"image_size": model["image_size"], "num_labels": classes,
                  "num_channels": model["channels"],
                  "id2label": {i: str(i) for i in range(classes)},
                  "label2id": {str(i): i for i in range(classes)}}
        save_pretrained(tensors, model.get("hf_config"), model.get("path"), out, fields)
        return out


FAMILY = HFVision()
