"""offload.target=cpu: saved storages wait in pinned host memory between forward and backward.

On CUDA, each storage is copied device->host on a side stream into a buffer of a bounded pinned
pool (allocated once, reused every step), and host->device on another side stream when backward
is about to need it. When the pool is full, a storage simply stays on the device (counted, logged
once): slower to fit, never wrong, never blocking.

When the compute device is the CPU there is nothing to move: the store keeps every storage as it
is, but the engine still goes through the whole hook path (handles, dedup, groups, prefetch), so
that path runs in every CPU test.
"""

from __future__ import annotations

import functools
import logging
from typing import Callable, Optional

import torch
from torch import Tensor

from offload.cuda import Copier, CudaCopier, Event, HoldUntil, HostSlot, PinnedPool, size_class
from offload.engine import OffloadError, resolve_device

NOTHING_TO_MOVE = "offload.target=cpu: compute device is the CPU, nothing to move"


class _HostTicket:
    __slots__ = ("nbytes", "slot", "copied", "kept", "kept_on_device", "restored",
                 "restored_ready")

    def __init__(self, nbytes: int) -> None:
        self.nbytes = nbytes
        self.slot: Optional[HostSlot] = None
        self.copied: Optional[Event] = None  # the device->host copy into `slot`
        self.kept: Optional[Tensor] = None  # the storage itself, when it did not move
        self.kept_on_device = False
        self.restored: Optional[Tensor] = None  # back on the device
        self.restored_ready: Optional[Event] = None


class CpuStore:
    """Pinned host memory for saved storages.

    device: the compute device. max_host_bytes: bound on the pinned pool (`offload.max_host_bytes`).
    copier: how bytes move; by default CUDA side streams on a CUDA device, nothing on the CPU.
    side_stream_delay: forwarded to the CUDA copier (tests inject `torch.cuda._sleep`).
    """

    def __init__(self, device: torch.device | str, max_host_bytes: int,
                 copier: Optional[Copier] = None,
                 side_stream_delay: Optional[Callable[[], None]] = None,
                 logger: Optional[logging.Logger] = None) -> None:
        self.device = resolve_device(device)
        self._owns_copier = copier is None  # a CUDA copier made here is closed here
        if copier is None and self.device.type == "cuda":
            copier = CudaCopier(self.device, side_stream_delay)
        elif copier is None and self.device.type != "cpu":
            raise OffloadError(f"offload.target=cpu: no copier for device {self.device}")
        self._copier = copier
        self.moves_data = copier is not None
        self.pool = PinnedPool(max_host_bytes, copier.allocate_host) if copier else None
        self._holds = HoldUntil()
        self._group_bytes: dict[int, int] = {}
        self._live = 0
        self._logger = logger or logging.getLogger(__name__)
        self._warned_full = False
        self.fallback_count = 0
        self.ready_gets = 0  # gets whose copy back had already finished: prefetch overlapped
        self.waited_gets = 0  # gets whose copy back was still running (or not yet started)

    def put(self, flat: Tensor, group: int) -> _HostTicket:
        ticket = _HostTicket(flat.numel())
        if self._copier is None:
            self._live += 1
            ticket.kept = flat
            return ticket
        self._holds.reap()
        self._count_group(group, size_class(ticket.nbytes))
        self._live += 1
        slot = self.pool.acquire(ticket.nbytes)
        if slot is None:
            self._keep_on_device(ticket, flat)
            return ticket
        ticket.slot = slot
        # Nothing of `flat` is kept: the copier frees it in stream order, after its copy.
        ticket.copied = self._copier.to_host(flat, slot.buffer[:ticket.nbytes],
                                             after=[self._copier.ready_event()])
        return ticket

    def prefetch(self, ticket: _HostTicket) -> None:
        if ticket.slot is not None and ticket.restored is None:
            self._restore(ticket)

    def get(self, ticket: _HostTicket) -> Tensor:
        if ticket.kept is not None:
            return ticket.kept
        if ticket.restored is None:
            if ticket.slot is None:
                raise RuntimeError("offload: a released storage was asked for")
            self._restore(ticket)
        if ticket.restored_ready is None or ticket.restored_ready.query():
            self.ready_gets += 1
        else:
            self.waited_gets += 1
        self._copier.wait(ticket.restored_ready)
        return ticket.restored

    def release(self, ticket: _HostTicket) -> None:
        self._live -= 1
        ticket.kept = None
        if ticket.slot is not None:
            # Never brought back: the device->host copy may still be writing the buffer.
            self._holds.add(ticket.copied, then=functools.partial(self.pool.release, ticket.slot))
            ticket.slot = None
        # Allocated on the consumer's stream, which waited for the copy before using it; if it
        # was only prefetched, the copier frees it after its copy (stream order) all the same.
        ticket.restored = None

    def poll(self) -> None:
        self._holds.reap()

    def backward_started(self) -> None:
        pass  # pinned pool slots are reused as they are; nothing to hand back

    def end_step(self) -> None:
        self._holds.drain()
        self._group_bytes.clear()
        if self._live != 0 or (self.pool is not None and self.pool.in_use_bytes != 0):
            raise RuntimeError(f"offload: CpuStore leaked {self._live} tickets, "
                               f"{self.pool.in_use_bytes if self.pool else 0} pinned bytes")

    def close(self) -> None:
        self._holds.drain()
        if self._owns_copier and isinstance(self._copier, CudaCopier):
            self._copier.close()  # unpins the pool's buffers

    def _restore(self, ticket: _HostTicket) -> None:
        stream = self._copier.current_stream()
        restored, allocated = self._copier.allocate_device(ticket.nbytes, stream)
        ticket.restored_ready = self._copier.to_device(
            ticket.slot.buffer[:ticket.nbytes], restored, after=[allocated, ticket.copied])
        ticket.restored = restored
        # The host copy has done its job once the copy back has read it.
        self._holds.add(ticket.restored_ready,
                        then=functools.partial(self.pool.release, ticket.slot))
        ticket.slot = None

    def _count_group(self, group: int, nbytes: int) -> None:
        total = self._group_bytes.get(group, 0) + nbytes
        self._group_bytes[group] = total
        if total > self.pool.max_bytes:
            raise OffloadError(
                f"offload.max_host_bytes: block {group} alone saves {total} bytes for backward "
                f"(in pinned size classes), more than the whole pinned pool of "
                f"{self.pool.max_bytes} bytes; raise offload.max_host_bytes or recompute the block")

    def _keep_on_device(self, ticket: _HostTicket, flat: Tensor) -> None:
        ticket.kept, ticket.kept_on_device = flat, True
        self.fallback_count += 1
        if not self._warned_full:
            self._warned_full = True
            self._logger.warning(
                "offload.max_host_bytes=%d: the pinned pool is full; saved tensors that do not "
                "fit stay on the device (logged once; see the offload stats for counts)",
                self.pool.max_bytes)
