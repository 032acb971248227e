"""Settings of the Hugging Face families (`model.arch=hf`, `hf_vision`) that can be checked
without torch: which fields the HF config has (given inline or saved in the model folder), and the
one-line error for a model given neither way or both."""

from __future__ import annotations

import json
import os

from trainer.config import ConfigError, ModelConfig, require

# HF config fields that change the logits beyond the output layer of the last hidden state: the
# fused head cannot apply them, and the plain head gathers supervised rows from HF's own logits.
LOGIT_FIELDS = ("final_logit_softcapping", "logit_scale", "logits_scaling", "output_multiplier")


def bent_logit_fields(hf_config) -> list[str]:
    """The LOGIT_FIELDS this HF config sets to something that changes the logits."""
    return [f for f in LOGIT_FIELDS if getattr(hf_config, f, None) not in (None, 1, 1.0)]


# HF attention implementations sequence parallelism runs (trainer/models/sequence_parallel.py
# builds their whole-sequence masks); here, without torch, for the validator.
HF_IMPLEMENTATIONS = ("sdpa", "eager")


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


def check_hf_source(m: ModelConfig) -> None:
    """Exactly one of model.path (a local save_pretrained folder) and model.hf_config."""
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
