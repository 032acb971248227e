"""Saved-activation offload: the hooks that move what a block saves for backward, and back.

`Offloader.block_context(i)` is entered around block i's forward. Every tensor autograd saves in
there goes through `_pack`: parameters, small tensors and tensors the store cannot move stay where
they are; everything else is handed to the store (pinned host memory, disk) once per storage,
however many views of it are saved and by however many blocks. `_unpack` brings it back in
backward, rebuilds exactly the view that was saved, and starts bringing back the block backward
needs next.

Autograd skips its in-place check ("modified by an inplace operation") for tensors saved through
hooks, and with an asynchronous copy an in-place write after saving could even race the copy.
So we redo the check ourselves, with a storage-less probe that shares the saved tensor's version
counter: an in-place write after saving raises where it would without offload, instead of giving
silently different gradients.
"""

from __future__ import annotations

import collections
import functools
import threading
from dataclasses import dataclass
from typing import Any, Callable, ContextManager, Optional, Protocol

import torch
from torch import Tensor, nn
from torch.multiprocessing.reductions import StorageWeakRef

from checkpointing.meter import is_parameter_like


class OffloadError(RuntimeError):
    """A configuration or resource problem; the message starts with the `offload.*` key to fix."""


def resolve_device(device: torch.device | str) -> torch.device:
    """The compute device with an explicit index, as saved tensors report theirs."""
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    return device


class Store(Protocol):
    """Where stored storages live between forward and backward.

    `put` receives a flat uint8 tensor over a whole storage and returns a ticket with a boolean
    `kept_on_device` (true when the store chose to keep it, e.g. its pool was full). Every ticket is
    released exactly once, by the engine.
    """

    device: torch.device
    moves_data: bool  # False: the store keeps tensors as they are (nothing to move)

    def put(self, flat: Tensor, group: int) -> Any: ...
    def prefetch(self, ticket: Any) -> None: ...
    def get(self, ticket: Any) -> Tensor: ...
    def release(self, ticket: Any) -> None: ...
    def poll(self) -> None: ...
    def backward_started(self) -> None: ...  # once per micro-batch, at its first unpack
    def end_step(self) -> None: ...
    def close(self) -> None: ...


@dataclass
class OffloadStats:
    """What one micro-batch's forward saved, and what became of it."""

    saved_count: int = 0      # tensors autograd saved under the hooks
    moved_count: int = 0      # distinct storages handed to the store
    offloaded_bytes: int = 0  # their bytes (whole storages)
    dedup_count: int = 0      # saves whose storage had already been handed over
    kept_count: int = 0       # saves left as they are: too small or not movable
    kept_bytes: int = 0       # their bytes (each save's own, a storage saved twice counts twice)
    excluded_count: int = 0   # parameters and views of parameters
    fallback_count: int = 0   # storages the store kept on the device (its pool was full)
    fallback_bytes: int = 0
    prefetched_groups: int = 0  # blocks whose bringing back started before their backward
    forced_releases: int = 0    # storages autograd still referenced at end_step


class _Entry:
    """One storage handed to the store in this step."""

    __slots__ = ("ticket", "storage_ref", "version", "nbytes", "data_ptr", "refs", "released")

    def __init__(self, ticket: Any, storage: torch.UntypedStorage, version: int) -> None:
        self.ticket = ticket
        # A weak reference pins the StorageImpl's address, so the dedup key (`_cdata`) cannot be
        # reused by another storage during the step, without keeping the memory alive.
        self.storage_ref = StorageWeakRef(storage)
        self.version = version
        self.nbytes, self.data_ptr = storage.nbytes(), storage.data_ptr()
        self.refs = 0
        self.released = False


class _Handle:
    """What autograd keeps in place of a saved tensor."""

    __slots__ = ("entry", "kept", "probe", "version", "size", "stride", "offset", "dtype",
                 "group", "dead")

    def __init__(self, version: int) -> None:
        self.version = version
        self.entry: Optional[_Entry] = None
        self.kept: Optional[Tensor] = None

    @classmethod
    def keep(cls, tensor: Tensor) -> "_Handle":
        handle = cls(tensor._version)
        handle.kept = tensor
        return handle

    @classmethod
    def stored(cls, tensor: Tensor, entry: _Entry, group: int,
               dead: collections.deque) -> "_Handle":
        handle = cls(tensor._version)
        # Shares the tensor's version counter but not its storage (`.data =` swaps the storage
        # and leaves the counter alone), so holding it costs no memory.
        probe = tensor.detach()
        probe.data = torch.empty(0, dtype=tensor.dtype, device=tensor.device)
        handle.probe = probe
        handle.size, handle.stride = tensor.size(), tensor.stride()
        handle.offset, handle.dtype = tensor.storage_offset(), tensor.dtype
        handle.group, handle.dead = group, dead
        handle.entry = entry
        entry.refs += 1
        return handle

    def check_version(self) -> None:
        tensor = self.kept if self.kept is not None else self.probe
        if tensor._version != self.version:
            size = list(tensor.size() if self.kept is not None else self.size)
            raise RuntimeError(
                "one of the variables needed for gradient computation has been modified by an "
                f"inplace operation: [{tensor.type()} {size}] is at version {tensor._version}; "
                f"expected version {self.version} instead. (Checked by blocktrain's offload "
                "hooks, as autograd does not check tensors saved through hooks.)")

    def view_of(self, flat: Tensor) -> Tensor:
        """The saved view, over the storage `flat` spans."""
        out = torch.empty(0, dtype=self.dtype, device=flat.device)
        return out.set_(flat.untyped_storage(), self.offset, self.size, self.stride)

    def __del__(self) -> None:
        # Autograd dropped the saved variable (its node ran, or the graph was freed). This can
        # run on any thread and in the middle of our own bookkeeping, so only queue it.
        if self.entry is not None:
            self.dead.append(self.entry)


class Offloader:
    """One per model (per training run). Owns the store and the per-block groups of one step.

    min_bytes: saved tensors smaller than this (their own bytes) stay where they are.
    exclude: tensors never offloaded; by default parameters and their views (FSDP's unsharded
    parameters too), which live on anyway.
    """

    def __init__(self, store: Store, min_bytes: int,
                 exclude: Callable[[Tensor], bool] = is_parameter_like) -> None:
        if min_bytes < 0:
            raise OffloadError(f"offload.min_bytes: {min_bytes} is negative")
        self.store = store
        self.min_bytes = min_bytes
        self.exclude = exclude
        self.stats = OffloadStats()
        # Packs run on the forward's thread, unpacks on autograd's (a device thread on CUDA).
        self._lock = threading.RLock()
        self._dead: collections.deque = collections.deque()
        self._step_open = False
        self._entries: dict[int, _Entry] = {}  # storage `_cdata` -> its entry
        self._all: list[_Entry] = []
        self._groups: dict[int, list[_Entry]] = {}  # block index -> entries, in forward order
        self._started: set[int] = set()  # blocks whose backward has begun
        self._fetching: set[int] = set()  # blocks whose entries the store was asked to bring back

    @property
    def moves_data(self) -> bool:
        return self.store.moves_data

    def block_context(self, index: int,
                      on_device: Optional[Callable[[Tensor], None]] = None) -> ContextManager:
        """Enter around block `index`'s forward (outside its checkpoint wrapper, if any).

        on_device: told of every saved tensor that stays in device memory (excluded, too small,
        not movable, a full pool, or a store with nothing to move), so a meter of device
        activations stays right while these hooks hide the tensors from outer hooks.
        """
        if on_device is None:
            pack = functools.partial(self._pack, index)
        else:
            def pack(tensor: Tensor) -> _Handle:
                handle = self._pack(index, tensor)
                if (handle.kept is not None or not self.moves_data
                        or handle.entry.ticket.kept_on_device):
                    on_device(tensor)
                return handle
        return torch.autograd.graph.saved_tensors_hooks(pack, self._unpack)

    def begin_step(self) -> None:
        """Before each micro-batch's forward. Ends a step left open (e.g. by an exception)."""
        if self._step_open:
            self.end_step()
        self.stats = OffloadStats()
        self._step_open = True

    def end_step(self) -> None:
        """After the micro-batch's backward: release everything, check the store leaked nothing."""
        with self._lock:
            self._reap()
            for entry in self._all:
                if not entry.released:
                    self.stats.forced_releases += 1
                    self._release(entry)
            self._entries.clear()
            self._all.clear()
            self._groups.clear()
            self._started.clear()
            self._fetching.clear()
            self._step_open = False
            self.store.end_step()

    def close(self) -> None:
        try:
            if self._step_open:
                self.end_step()
        finally:
            self.store.close()

    def __enter__(self) -> "Offloader":
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    # --- hooks -----------------------------------------------------------------------------

    def _pack(self, group: int, tensor: Tensor) -> _Handle:
        with self._lock:
            self._reap()
            if not self._step_open:
                raise RuntimeError("Offloader.begin_step() must be called before a forward that "
                                   "saves tensors under block_context")
            self.stats.saved_count += 1
            if self.exclude(tensor):
                self.stats.excluded_count += 1
                return _Handle.keep(tensor)
            if not self._movable(tensor):
                self.stats.kept_count += 1
                self.stats.kept_bytes += tensor.numel() * tensor.element_size()
                return _Handle.keep(tensor)
            storage = tensor.untyped_storage()
            entry = self._entries.get(storage._cdata)
            # A storage written in place (or resized) since it was stored holds other data now.
            if (entry is not None and not entry.released and entry.version == tensor._version
                    and (entry.data_ptr, entry.nbytes) == (storage.data_ptr(), storage.nbytes())):
                self.stats.dedup_count += 1
            else:
                entry = self._store(storage, tensor, group)
            members = self._groups.setdefault(group, [])
            if not members or members[-1] is not entry:
                members.append(entry)
            return _Handle.stored(tensor, entry, group, self._dead)

    def _unpack(self, handle: _Handle) -> Tensor:
        handle.check_version()
        if handle.kept is not None:
            return handle.kept
        with self._lock:
            self._reap()
            entry = handle.entry
            if entry.released:
                raise RuntimeError("offload: a saved tensor was used after end_step released it "
                                   "(backward after Offloader.end_step()?)")
            self._begin_backward_of(handle.group)
            flat = self.store.get(entry.ticket)
        return handle.view_of(flat)

    # --- bookkeeping -----------------------------------------------------------------------

    def _movable(self, tensor: Tensor) -> bool:
        """A plain dense tensor on the compute device, whose bytes are all it is."""
        if type(tensor) not in (Tensor, nn.Parameter) or tensor.layout != torch.strided:
            return False
        if tensor.is_nested or tensor.is_quantized or tensor.is_conj() or tensor.is_neg():
            return False  # their meaning is not just the bytes of one storage
        if torch._C._functorch.is_functorch_wrapped_tensor(tensor):
            return False
        if tensor.device != self.store.device:
            return False
        return (tensor.numel() * tensor.element_size() >= self.min_bytes
                and tensor.untyped_storage().nbytes() > 0)

    def _store(self, storage: torch.UntypedStorage, tensor: Tensor, group: int) -> _Entry:
        # The whole storage moves, so every view of it can be rebuilt from one copy.
        flat = torch.empty(0, dtype=torch.uint8, device=tensor.device).set_(storage)
        ticket = self.store.put(flat, group)
        entry = _Entry(ticket, storage, tensor._version)
        self._entries[storage._cdata] = entry
        self._all.append(entry)
        if ticket.kept_on_device:
            self.stats.fallback_count += 1
            self.stats.fallback_bytes += entry.nbytes
        else:
            self.stats.moved_count += 1
            self.stats.offloaded_bytes += entry.nbytes
        return entry

    def _begin_backward_of(self, group: int) -> None:
        """First unpack of a block: bring back the rest of it, and the block backward needs next."""
        if group in self._started:
            return
        if not self._started:
            self.store.backward_started()
        self._started.add(group)
        self._fetch(group)
        order = list(self._groups)
        position = order.index(group) if group in self._groups else 0
        if position > 0:
            previous = order[position - 1]
            if previous not in self._fetching:
                self.stats.prefetched_groups += 1
                self._fetch(previous)

    def _fetch(self, group: int) -> None:
        if group in self._fetching:
            return
        self._fetching.add(group)
        for entry in self._groups.get(group, ()):
            if not entry.released:
                self.store.prefetch(entry.ticket)

    def _reap(self) -> None:
        """Release the storages autograd no longer references; let the store finish copies."""
        while self._dead:
            entry = self._dead.popleft()
            entry.refs -= 1
            if entry.refs == 0 and not entry.released:
                self._release(entry)
        self.store.poll()

    def _release(self, entry: _Entry) -> None:
        entry.released = True
        self.store.release(entry.ticket)
