"""Hugging Face image classifiers as blocktrain models (`model.arch=hf_vision`).

Any `AutoModelForImageClassification` (ViT, DeiT, BEiT, DINOv2, Swin, ...), built from a config
(`model.hf_config`, random init) or from a local `save_pretrained` folder (`model.path`), never
over the network. The image size and class count come from `model.image_size` and
`model.num_classes`, so a pretrained model fine-tunes at another resolution (its position
embeddings are resized as the 2-D grid they are) and on other classes (a new head). Parameters
are built on the meta device and each is read from the safetensors files on its own, as for
`model.arch=hf`; the encoder layers are found as the repeated blocks like any model's.

The wrapper makes the trainer's contract: `model(images) -> logits`; `init_param(name, full,
generator)`; `reset_buffers()`.
"""

from __future__ import annotations

import json
import logging
import os
from typing import Any, Mapping, Optional

import torch
from torch import nn

from trainer.models.hf import PREFIX, HFModelError, HFWrapper, _hf_config, _parameters_on_meta
from trainer.models.vit import resize_positions

log = logging.getLogger("trainer")
# Where ViT-family models keep their learned position table ([1, 1 + grid*grid, dim]).
POSITION_SUFFIX = "embeddings.position_embeddings"


def checkpoint_names(hf_model: nn.Module, keys) -> dict[str, str]:
    """Model parameter name -> the name it is saved under. transformers 5 renames modules on
    load (ViT's `encoder.layer.N.attention.attention.query` is `layers.N.attention.q_proj`)
    and saves under the old names; its own renaming rules map them. A model whose checkpoint
    needs tensors merged or split (a WeightConverter) is not read tensor by tensor here."""
    try:
        from transformers.conversion_mapping import get_model_conversion_mapping
        from transformers.core_model_loading import WeightRenaming, rename_source_key
    except ImportError:  # an older transformers: saved names are the model's
        return {k: k for k in keys}
    rules = get_model_conversion_mapping(hf_model)
    renamings = [r for r in rules if isinstance(r, WeightRenaming)]
    converters = [r for r in rules if not isinstance(r, WeightRenaming)]
    meta = dict(hf_model.state_dict())
    names = {}
    for key in keys:
        name, converted = rename_source_key(key, renamings, converters,
                                            hf_model.base_model_prefix, meta)
        if converted is not None:
            raise HFModelError(f"model.path: {key} must be converted ({converted}) to load, which "
                               "blocktrain does not do tensor by tensor; save the model with this "
                               "transformers version first")
        names[name] = key
    return names


def _is_head(hf_model: nn.Module, hf_name: str) -> bool:
    head = getattr(hf_model, "classifier", None)
    return head is not None and any(hf_name == f"classifier.{n}"
                                    for n, _ in head.named_parameters())


class HFImageClassifier(HFWrapper):
    def __init__(self, hf_model: nn.Module, checkpoint: Optional[str] = None) -> None:
        super().__init__(hf_model, checkpoint)
        self._saved_as = (checkpoint_names(hf_model, self._reader._where)
                          if self._reader is not None else {})

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        return self.hf(pixel_values=images).logits

    def flops_per_token(self, tokens: int) -> float:
        """6 N + 12 L d T over the patch tokens, N the parameters outside the patch embedding."""
        c = self.hf.config
        embed = sum(p.numel() for n, p in self.named_parameters()
                    if "embeddings" in n and "position" not in n)
        n = sum(p.numel() for p in self.parameters()) - embed
        return float(6 * n + 12 * c.num_hidden_layers * c.hidden_size * (tokens + 1))

    @torch.no_grad()
    def init_param(self, name: str, full: torch.Tensor, generator: torch.Generator) -> None:
        hf_name = name[len(PREFIX):] if name.startswith(PREFIX) else name
        if hf_name in self._saved_as:
            saved = self._reader.raw(self._saved_as[hf_name])
            if saved.shape == full.shape:
                full.copy_(saved.to(full.dtype))
                return
            if hf_name.endswith(POSITION_SUFFIX):  # another resolution than pretraining
                grid = round((full.shape[1] - 1) ** 0.5)
                full.copy_(resize_positions(saved, grid).to(full.dtype))
                return
            if not _is_head(self.hf, hf_name):
                raise HFModelError(f"model.path: {hf_name} is {tuple(saved.shape)} in the "
                                   f"checkpoint but {tuple(full.shape)} in this model")
            log.info(f"model.path: the pretrained {hf_name} has shape {tuple(saved.shape)}, "
                     f"this model.num_classes needs {tuple(full.shape)}: it starts from scratch")
        elif self._reader is not None and not _is_head(self.hf, hf_name):
            raise HFModelError(f"model.path: the checkpoint has no {hf_name}")
        if full.ndim >= 2 or hf_name.endswith(("cls_token", "mask_token")):
            nn.init.trunc_normal_(full, mean=0.0, std=self._std, generator=generator)
        elif hf_name.endswith("bias"):
            full.zero_()
        else:  # norm scales, layer scales
            full.fill_(1.0)


def build_hf_vision_on_meta(hf_config: Any, path: Optional[str], image_size: int,
                            num_classes: int, channels: int, dropout: Optional[float] = None,
                            attn_implementation: str = "sdpa") -> HFImageClassifier:
    """The wrapped classifier with parameters on meta, at this image size and class count;
    `path` also makes init_param load (and resize) the pretrained weights."""
    from transformers import AutoModelForImageClassification

    config = _hf_config(hf_config, path)
    config.image_size, config.num_labels, config.num_channels = image_size, num_classes, channels
    config.id2label = {i: str(i) for i in range(num_classes)}
    config.label2id = {str(i): i for i in range(num_classes)}
    # Hidden dropout only: dropping attention probabilities takes SDPA off its fused kernels
    # onto the path that keeps each T x T matrix (at 1024 px, 4097^2 x heads per layer, 805 MB
    # for ViT-B in fp32). hf_config's attention_probs_dropout_prob still sets it on purpose.
    if dropout is not None and hasattr(config, "hidden_dropout_prob"):
        config.hidden_dropout_prob = dropout
    config._attn_implementation = attn_implementation
    with _parameters_on_meta():
        model = AutoModelForImageClassification.from_config(config)
    return HFImageClassifier(model, checkpoint=path)


def preprocessing(path: Optional[str]) -> Optional[dict]:
    """The model's own image preprocessing (mean, std, resample) from the folder's
    preprocessor_config.json, when it has one."""
    if not path or not os.path.isfile(os.path.join(path, "preprocessor_config.json")):
        return None
    with open(os.path.join(path, "preprocessor_config.json")) as f:
        saved: Mapping = json.load(f)
    return {k: saved[k] for k in ("image_mean", "image_std", "resample") if k in saved}
