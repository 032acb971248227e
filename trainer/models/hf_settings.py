"""Settings of `model.arch=hf` that can be checked without torch: which fields the HF config
has (given inline or saved in the model folder), the vocabulary the data must fit, and the
one-line errors for a model that cannot be built."""

from __future__ import annotations

import json
import os

from trainer.config import Config, ConfigError, ModelConfig, require


def hf_fields(m: ModelConfig) -> dict:
    """The HF config's fields as given (hf_config) or saved (path/config.json)."""
    if m.path:
        path = os.path.join(m.path, "config.json")
        try:
            with open(path) as f:
                fields = json.load(f)
        except ValueError as exc:
            raise ConfigError("model.path", f"{path} is not valid JSON ({exc})") from None
        if not isinstance(fields, dict):
            raise ConfigError("model.path", f"{path} must hold a JSON object")
        return fields
    return dict(m.hf_config or {})


def model_vocab_size(m: ModelConfig) -> int:
    if m.arch != "hf":
        return m.vocab_size
    # 32000 is what transformers' Llama config defaults to when vocab_size is not given.
    return int(hf_fields(m).get("vocab_size", 32000))


def check_hf(cfg: Config) -> None:
    m = cfg.model
    require((m.path is None) != (m.hf_config is None), "model.path",
            "model.arch=hf needs exactly one of model.path=<local folder> or "
            "model.hf_config={model_type: ..., ...}")
    if m.path is not None:
        require(os.path.isfile(os.path.join(m.path, "config.json")), "model.path",
                f"{m.path} has no config.json (a folder written by save_pretrained; nothing "
                "is downloaded)")
    else:
        require(isinstance(m.hf_config, dict) and "model_type" in m.hf_config,
                "model.hf_config", "must be a mapping with model_type, e.g. "
                "{model_type: llama, hidden_size: 128, num_hidden_layers: 2}")
    if m.arch == "hf_vision":
        patch = int(hf_fields(m).get("patch_size", 16))
        require(m.patch_size == patch, "model.patch_size",
                f"must be the model's own patch size {patch}, got {m.patch_size}")
    if m.arch == "hf":
        require(m.dropout == 0, "model.dropout",
                "unused with model.arch=hf; set the HF config's own dropout fields instead")
