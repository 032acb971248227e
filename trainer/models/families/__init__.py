"""The model families and the registry that maps `model.arch` to one: the only place `arch` is read.

    family = family_of(cfg.model)        # refuses an unknown arch with a one-line ConfigError
    model = family.build_on_meta(cfg.model)

Each family is one module here holding one object (base.py says what it answers). Adding a
family is that module, a line below, a conf/model/<name>.yaml with its `arch`, and its tests.
Importing the registry does not import torch.
"""

from __future__ import annotations

from typing import Mapping

from trainer.config import ModelConfig, require
from trainer.models.families import hf, hf_vision, llama, qwen3, timm, vit
from trainer.models.families.base import Family, ImageClassifier, LanguageModel, Task

FAMILIES: dict[str, Family] = {f.arch: f for f in (llama.FAMILY, hf.FAMILY, vit.FAMILY,
                                                   hf_vision.FAMILY, timm.FAMILY, qwen3.FAMILY)}

__all__ = ["FAMILIES", "Family", "ImageClassifier", "LanguageModel", "Task", "family_named",
           "family_of", "family_of_saved"]


def family_named(arch: str) -> Family:
    """The family of a model.arch value (also a saved checkpoint's)."""
    require(arch in FAMILIES, "model.arch", f"got {arch!r}; choose one of {', '.join(FAMILIES)}")
    return FAMILIES[arch]


def family_of(m: ModelConfig) -> Family:
    return family_named(m.arch)


def family_of_saved(model: Mapping) -> Family:
    """The family of a checkpoint's model section (a mapping, as saved)."""
    return family_named(model.get("arch", ModelConfig.arch))
