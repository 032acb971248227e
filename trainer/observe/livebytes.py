"""Measuring the real peak of live tensor memory, for checking the memory model on CPU
(`logging.live_bytes_step`, the tests, `python -m launch.bench --memory-gib`).

`LiveTensorBytes` is a dispatch mode: every op's outputs have their storages recorded (weakly),
and after each op the bytes of all recorded storages still alive are summed; the largest sum is
the peak. Storages are summed at their current size rather than the size they were created with,
because FSDP frees and re-allocates unsharded parameters by resizing their storage in place,
which no op reports. Tensors alive before the mode starts (parameters, optimizer state, the
batch) are passed in and count from the start. DTensors are counted by their local tensor, and
the functional collectives' AsyncCollectiveTensor (Ulysses' all-to-all results) by the tensor it
wraps: a wrapper subclass has a storage object of its own, of the full size, but no memory, and
every view of one is a new wrapper (counting them over-counted a sequence-parallel step).
Temporaries a kernel allocates internally and frees before returning are not seen; neither are
they in the memory model.
"""

from __future__ import annotations

import weakref
from typing import Iterable

import torch
from torch.distributed._functional_collectives import AsyncCollectiveTensor
from torch.distributed.tensor import DTensor
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from checkpointing.head import SeeInsideHead


class _LiveTensorBytes(TorchDispatchMode):
    def __init__(self, alive_before: Iterable[torch.Tensor]) -> None:
        super().__init__()
        self._storages: dict[int, weakref.ref] = {}
        for tensor in alive_before:
            self._record(tensor)
        self.baseline = self.current()
        self.peak = self.baseline

    def _record(self, tensor: torch.Tensor) -> None:
        if isinstance(tensor, DTensor):
            tensor = tensor.to_local()
        while isinstance(tensor, AsyncCollectiveTensor):
            tensor = tensor.elem
        if not isinstance(tensor, torch.Tensor):
            return
        storage = tensor.untyped_storage()
        key = storage._cdata
        if key not in self._storages:
            self._storages[key] = weakref.ref(storage)
            # Storages keep one Python object for life, so this runs when the memory goes.
            weakref.finalize(storage, self._storages.pop, key, None)

    def current(self) -> int:
        alive = (ref() for ref in list(self._storages.values()))
        return sum(storage.nbytes() for storage in alive if storage is not None)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for leaf in tree_leaves(out):
            if isinstance(leaf, torch.Tensor):
                self._record(leaf)
        self.peak = max(self.peak, self.current())
        return out


class LiveTensorBytes(SeeInsideHead, _LiveTensorBytes):
    """Also inside the chunked head: its chunk's logits are live memory like any other."""


def tensors_of(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    """Parameters, gradients and optimizer state: what lives across steps."""
    tensors = [p for p in model.parameters()]
    tensors += [p.grad for p in model.parameters() if p.grad is not None]
    tensors += [v for state in optimizer.state.values() for v in state.values()
                if isinstance(v, torch.Tensor)]
    return tensors


def step_tracker(on: bool, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
                 micro_batches: list) -> "LiveTensorBytes | None":
    """logging.live_bytes_step: a tracker for this training step (what lives across steps and
    the step's batch count from the start), else None."""
    if not on:
        return None
    return LiveTensorBytes(tensors_of(model, optimizer) + [x for b in micro_batches for x in b])
