"""timm image classifiers (`model.arch=timm`, trainer/models/timm_vision.py): a timm model by
model.name (or a local-dir: folder), pretrained weights from model.checkpoint_path. timm's
attention modules call F.scaled_dot_product_attention inside their own forward; wrap_attention
redirects that call to each module's `attend` (trainer/models/attention.py)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Callable, Mapping, Optional

from trainer.config import ModelConfig
from trainer.models.families.base import ImageClassifier

if TYPE_CHECKING:
    import torch
    from torch import nn


class Timm(ImageClassifier):
    arch = "timm"

    def validate(self, m: ModelConfig, seq_len: int) -> None:
        """timm importable, the model known, timm_args accepted, the patch size the model's
        (this builds the model on meta, so it imports torch and timm)."""
        super().validate(m, seq_len)
        from trainer.models.timm_vision import check_timm

        check_timm(m)

    def build_on_meta(self, m: ModelConfig) -> nn.Module:
        from trainer.models.timm_vision import build_timm_on_meta

        return build_timm_on_meta(m.name, m.checkpoint_path, m.image_size, m.num_classes,
                                  m.channels, m.dropout, m.timm_args)

    def attention_modules(self, model: nn.Module) -> list[nn.Module]:
        """timm's attention modules: those with its `fused_attn` switch (which must be on for
        the redirect to see their attention; it is unless TIMM_FUSED_ATTN=0)."""
        return [module for module in model.modules() if hasattr(module, "fused_attn")]

    def wrap_attention(self, model: nn.Module, wrap: Callable) -> int:
        from trainer.models.attention import redirect_sdpa, wrap_attend

        modules = self.attention_modules(model)
        for module in modules:
            redirect_sdpa(module)
        return wrap_attend(modules, wrap)

    def image_preprocessing(self, m: ModelConfig) -> Optional[dict]:
        """timm's pretrained config of the model: mean, std, interpolation."""
        from trainer.models.timm_vision import preprocessing

        return preprocessing(m.name, m.timm_args)

    def export(self, tensors: Mapping[str, torch.Tensor], model: Mapping, out: str, step: int,
               checkpoint: str) -> str:
        """A folder timm loads: create_model("local-dir:<out>")."""
        from trainer.models.timm_vision import save_for_timm

        return save_for_timm(tensors, model, out)


FAMILY = Timm()
