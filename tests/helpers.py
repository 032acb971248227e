"""Shared test helpers: configs composed exactly as the trainer composes them."""

from __future__ import annotations

from trainer.build import llama_args
from trainer.cli import compose
from trainer.config import Config
from trainer.model import LlamaArgs


def config(*overrides: str) -> Config:
    return compose(list(overrides))


def preset(name: str) -> LlamaArgs:
    """The Llama shapes of conf/model/<name>.yaml (the one place presets are defined)."""
    return llama_args(config(f"model={name}").model)
