"""Counting what a step keeps for backward, per storage.

Two routes lead to a tensor being kept: autograd's saved tensors (seen by saved-tensor hooks,
including the inputs a checkpointed block keeps), and the op outputs that selective
checkpointing caches itself (its contexts bypass the hooks, so its wrapper reports them through
`add`). Parameters and views of parameters (FSDP's unsharded parameters too, which autograd saves
for the weight gradient) are not activations and are not counted.
"""

from __future__ import annotations

import contextlib
from typing import Iterator

import torch
from torch import nn


def is_parameter_like(tensor: torch.Tensor) -> bool:
    return isinstance(tensor, nn.Parameter) or isinstance(tensor._base, nn.Parameter)


class SavedBytesMeter:
    """Bytes of distinct storages kept for backward during `with meter.measure():`.

    A storage saved by several ops or through several views counts once, as it costs once.
    `peak` is the largest total of any measured forward since `reset_peak()`.
    With `enabled` False, `measure()` installs nothing: the hooks run Python for every saved
    tensor (and, under selective checkpointing, a dispatch mode sees every op of the blocks), a
    cost the trainer pays only on the steps whose figure it logs.
    """

    def __init__(self) -> None:
        self.bytes = 0
        self.peak = 0
        self.active = False
        self.enabled = True
        self.sizes: list[int] = []  # bytes of each distinct storage of the last measurement
        self._seen: dict[int, torch.UntypedStorage] = {}

    def add(self, tensor: torch.Tensor) -> None:
        if not self.active or not isinstance(tensor, torch.Tensor) or is_parameter_like(tensor):
            return
        storage = tensor.untyped_storage()
        key = storage._cdata  # the StorageImpl: shared by every view, also on the meta device
        if key not in self._seen:
            # Holding the storage keeps its address from being reused while we count.
            self._seen[key] = storage
            self.bytes += storage.nbytes()
            self.sizes.append(storage.nbytes())

    def _pack(self, tensor: torch.Tensor) -> torch.Tensor:
        self.add(tensor)
        return tensor

    def measure(self) -> contextlib.AbstractContextManager:
        return self._measuring() if self.enabled else contextlib.nullcontext(self)

    @contextlib.contextmanager
    def _measuring(self) -> Iterator["SavedBytesMeter"]:
        self.bytes, self.active, self.sizes = 0, True, []
        try:
            with torch.autograd.graph.saved_tensors_hooks(self._pack, lambda t: t):
                yield self
        finally:
            self.active = False
            self._seen.clear()
            self.peak = max(self.peak, self.bytes)

    def reset_peak(self) -> None:
        self.peak = 0
