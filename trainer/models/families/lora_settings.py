"""model.lora (trainer/config.py's LoraSettings): what a resume must match. No torch: trainer/validate.py checks with it before any process group exists."""

from __future__ import annotations

import json
import os
from typing import Optional

from trainer.config import ConfigError, LoraSettings

ADAPTER_FILES = ("adapter_config.json", "adapter_model.safetensors")  # PEFT's adapter folder
STARTS_ONLY = ("adapter",)  # where the adapters start: a resume starts from its checkpoint


def lora_changes(saved: Optional[dict], now: Optional[dict]) -> list[str]:
    """`model.lora.<key> <saved> -> <now>` for each LoRA setting a resume would change (dicts
    as dataclasses.asdict writes them; a checkpoint from before model.lora existed: off)."""
    was, is_ = dict(LoraSettings().__dict__), dict(LoraSettings().__dict__)
    was.update(saved or {})
    is_.update(now or {})
    return [f"model.lora.{key} {was[key]!r} -> {is_[key]!r}" for key in sorted(is_)
            if key not in STARTS_ONLY and was.get(key) != is_[key]]


def adapter_config(lora: LoraSettings, base: Optional[str]) -> dict:
    """model.lora.adapter's adapter_config.json, once the folder is an adapter for this run:
    a LoRA adapter of r = model.lora.rank and lora_alpha = model.lora.alpha on the base
    model.path names (its tensors' names and shapes: lora.py's load_adapter, on the meta model)."""
    key, path = "model.lora.adapter", lora.adapter
    if not os.path.isdir(path):
        raise ConfigError(key, f"{path}: no such folder (a PEFT adapter folder, as "
                          "`python -m trainer.export CHECKPOINT --adapter` writes)")
    missing = [name for name in ADAPTER_FILES if not os.path.isfile(os.path.join(path, name))]
    if missing:
        raise ConfigError(key, f"{path} is not a PEFT adapter folder: no {' or '.join(missing)}")
    try:
        with open(os.path.join(path, ADAPTER_FILES[0])) as f:
            saved = json.load(f)
    except (OSError, ValueError) as exc:
        raise ConfigError(key, f"{path}/{ADAPTER_FILES[0]} does not read as JSON: {exc}")
    if not isinstance(saved, dict) or saved.get("peft_type", "LORA") != "LORA":
        raise ConfigError(key, f"{path} is not a LoRA adapter (peft_type "
                          f"{saved.get('peft_type') if isinstance(saved, dict) else None})")
    if saved.get("r") != lora.rank:
        raise ConfigError("model.lora.rank", f"{lora.rank}, but the adapter at {path} has "
                          f"r={saved.get('r')}; set model.lora.rank={saved.get('r')}")
    if saved.get("lora_alpha") != lora.alpha:
        raise ConfigError("model.lora.alpha", f"{lora.alpha}, but the adapter at {path} has "
                          f"lora_alpha={saved.get('lora_alpha')}; set it the same")
    other = saved.get("base_model_name_or_path")
    if other != base and not (other and base and _same_folder(other, base)):
        raise ConfigError(key, f"{path} adapts another base ({other or 'the built-in model'}), "
                          f"not model.path={base}")
    return saved


def _same_folder(a: str, b: str) -> bool:
    return os.path.isdir(a) and os.path.isdir(b) and os.path.samefile(a, b)
