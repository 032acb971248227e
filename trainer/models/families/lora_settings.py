"""model.lora (trainer/config.py's LoraSettings): what a resume must match. No torch: trainer/validate.py checks with it before any process group exists."""

from __future__ import annotations

from typing import Optional

from trainer.config import LoraSettings


def lora_changes(saved: Optional[dict], now: Optional[dict]) -> list[str]:
    """`model.lora.<key> <saved> -> <now>` for each LoRA setting a resume would change (dicts
    as dataclasses.asdict writes them; a checkpoint from before model.lora existed: off)."""
    was, is_ = dict(LoraSettings().__dict__), dict(LoraSettings().__dict__)
    was.update(saved or {})
    is_.update(now or {})
    return [f"model.lora.{key} {was[key]!r} -> {is_[key]!r}" for key in sorted(is_)
            if was.get(key) != is_[key]]
