"""Pretrained weights read one tensor at a time from a folder's *.safetensors files.

The files are memory-mapped and each rank reads a tensor only when `materialize` initialises that
parameter, keeping its shard: no rank ever holds the whole model (trainer/build.py).
"""

from __future__ import annotations

import glob
import os

import torch
from torch import nn


class BufferKeeper(nn.Module):
    """A wrapper around a model built on meta with real buffers (rotary tables and the like,
    computed at construction, not in checkpoints): keeps their values, and puts them back after
    to_empty() wipes them."""

    def keep_buffers(self) -> None:
        self._buffer_values = {name: b.detach().clone() for name, b in self.named_buffers()}

    @torch.no_grad()
    def reset_buffers(self) -> None:
        for name, value in self._buffer_values.items():
            buffer = self.get_buffer(name)
            buffer.copy_(value.to(device=buffer.device, dtype=buffer.dtype))


class WeightsError(ValueError):
    """Weights that do not fit the model; the message starts with `model.path:`."""


class SafetensorsReader:
    def __init__(self, folder: str) -> None:
        from safetensors import safe_open

        files = sorted(glob.glob(os.path.join(folder, "*.safetensors")))
        if not files:
            raise WeightsError(f"model.path: {folder} has no *.safetensors weights")
        self._handles = [safe_open(f, framework="pt") for f in files]
        self._where = {key: h for h in self._handles for key in h.keys()}

    def __contains__(self, name: str) -> bool:
        return name in self._where

    def raw(self, name: str) -> torch.Tensor:
        handle = self._where.get(name)
        if handle is None:
            raise WeightsError(f"model.path: the checkpoint has no tensor {name!r} (is it the "
                               "same architecture as its config.json?)")
        return handle.get_tensor(name)

    def get(self, name: str, shape: torch.Size) -> torch.Tensor:
        tensor = self.raw(name)
        if tensor.shape != shape:
            raise WeightsError(f"model.path: {name} has shape {tuple(tensor.shape)} in the "
                               f"checkpoint, {tuple(shape)} in the model")
        return tensor
