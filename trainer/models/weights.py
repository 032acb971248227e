"""Pretrained weights read one tensor at a time from a folder's *.safetensors files.

The files are memory-mapped and each rank reads a tensor only when `materialize` initialises that
parameter, keeping its shard: no rank ever holds the whole model (trainer/build.py).
"""

from __future__ import annotations

import glob
import json
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


INDEX = "model.safetensors.index.json"  # a sharded checkpoint: tensor name -> shard file


class SafetensorsReader:
    def __init__(self, folder: str) -> None:
        files = sorted(glob.glob(os.path.join(folder, "*.safetensors")))
        _check_shards(folder)
        if not files:
            raise WeightsError(f"model.path: {folder} has no *.safetensors weights")
        self._where = {}  # tensor name -> (file, its open handle)
        for path in files:
            handle = _open(path)
            self._where.update({key: (path, handle) for key in handle.keys()})

    def __contains__(self, name: str) -> bool:
        return name in self._where

    def raw(self, name: str) -> torch.Tensor:
        found = self._where.get(name)
        if found is None:
            raise WeightsError(f"model.path: the checkpoint has no tensor {name!r} (is it the "
                               "same architecture as its config.json?)")
        path, handle = found
        try:
            return handle.get_tensor(name)
        except Exception as error:  # the file changed or was cut after it was opened
            raise WeightsError(f"model.path: {path}: tensor {name!r} cannot be read "
                               f"({_first_line(error)})") from None

    def get(self, name: str, shape: torch.Size) -> torch.Tensor:
        tensor = self.raw(name)
        if tensor.shape != shape:
            raise WeightsError(f"model.path: {name} has shape {tuple(tensor.shape)} in the "
                               f"checkpoint, {tuple(shape)} in the model")
        return tensor


def _open(path: str):
    """A safetensors file, or WeightsError naming it: safetensors' own error names no file."""
    from safetensors import safe_open

    try:
        return safe_open(path, framework="pt")
    except Exception as error:  # SafetensorError (an empty or cut file), OSError
        raise WeightsError(f"model.path: {path} is not a complete safetensors file "
                           f"({_first_line(error)}); copy or download it again") from None


def _check_shards(folder: str) -> None:
    """Every shard the index names is there (a missing one is named, not a tensor in it)."""
    index = os.path.join(folder, INDEX)
    if not os.path.exists(index):
        return
    try:
        with open(index) as f:
            weight_map = json.load(f)["weight_map"]
        shards = sorted(set(weight_map.values()))
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as error:
        raise WeightsError(f"model.path: {index} is not a readable index ({error})") from None
    missing = [s for s in shards if not os.path.exists(os.path.join(folder, s))]
    if missing:
        count = sum(1 for s in weight_map.values() if s == missing[0])
        more = f" (and {len(missing) - 1} more shards)" if len(missing) > 1 else ""
        raise WeightsError(f"model.path: {os.path.join(folder, missing[0])} is missing{more}; "
                           f"{INDEX} puts {count} tensors in it")


def _first_line(error: BaseException) -> str:
    return next((line.strip() for line in str(error).splitlines() if line.strip()),
                type(error).__name__)
