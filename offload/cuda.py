"""Moving bytes between the compute device and host memory without stalling compute.

- `PinnedPool`: page-locked host buffers of the sizes asked for (to a page), allocated on first need
  and reused every step after, never more than `max_bytes` in all.
- `CudaCopier`: copies on side streams, ordered against the compute stream by events.
- `HoldUntil`: defers callbacks (a pinned buffer's return to its pool) until an event completed.

Device memory a copy reads or writes is freed in stream order: the copier records the copy's
stream on it (`record_stream`), so the caller drops its reference at once and the caching
allocator hands the block out again only once the copy has run. Holding a reference until the
CPU sees the copy's event done instead kept it allocated for as long as the CPU ran ahead of
the GPU: at the loss head, most block inputs of an offloaded forward were still allocated, and
the allocator cannot reclaim a held block under memory pressure, while it waits for a recorded
one (issue 29, item 4). Host buffers are the pool's, not the allocator's: they are still
returned to the pool by a callback once the copy's event has completed.

The stores use a copier only through the `Copier` protocol, so their bookkeeping (which buffer is
free when, what must stay alive until which copy has finished) also runs, and is tested, on
CPU-only machines with a copier that copies on a background thread.
"""

from __future__ import annotations

import threading
from typing import Any, Callable, Optional, Protocol, Sequence

import torch
from torch import Tensor

# Pinning works on whole pages: a buffer's size class is its size rounded up to one.
PAGE_BYTES = 4096


class Event(Protocol):
    def query(self) -> bool: ...
    def synchronize(self) -> None: ...


class Copier(Protocol):
    """Asynchronous copies between the compute device and host buffers.

    Every method that takes `after` orders the copy after those events (None entries are ignored).
    "Stream" is whatever the copier uses to order work; for CUDA a `torch.cuda.Stream`.
    A copy's device tensors stay valid until it has run, whenever the caller drops them (CUDA:
    recorded on the copy's stream; a copier on threads holds them until done).
    """

    device: torch.device

    # Page-locked host memory of nbytes (to a page), kept until the copier is closed.
    def allocate_host(self, nbytes: int) -> Tensor: ...
    def current_stream(self) -> Any: ...
    def ready_event(self) -> Optional[Event]: ...
    def allocate_device(self, nbytes: int, stream: Any) -> tuple[Tensor, Optional[Event]]: ...
    def to_host(self, src: Tensor, dst: Tensor, after: Sequence[Optional[Event]]) -> Event: ...
    def to_device(self, src: Tensor, dst: Tensor, after: Sequence[Optional[Event]]) -> Event: ...
    def wait(self, event: Optional[Event]) -> None: ...


class CudaCopier:
    """Copies on two side streams of `device`, one per direction.

    One stream per direction so that a step's device->host copies never queue behind another
    micro-batch's host->device copies, or the other way round.
    delay: run on the side stream before every copy (tests: `lambda: torch.cuda._sleep(n)`), to
    show that results do not depend on when copies finish.
    """

    def __init__(self, device: torch.device, delay: Optional[Callable[[], None]] = None) -> None:
        self.device = device
        self._to_host_stream = torch.cuda.Stream(device)
        self._to_device_stream = torch.cuda.Stream(device)
        self._delay = delay
        self._registered: list[Tensor] = []  # pinned host buffers, unpinned by close()

    def allocate_host(self, nbytes: int) -> Tensor:
        """nbytes of page-locked memory, pinned as asked: torch's pinned allocator
        (pin_memory=True) would round every request up to a power of two and cache it, so a 5 GiB
        buffer would pin 8 GiB. Ordinary memory is pinned here page by page (cudaHostRegister)
        instead; the buffer stays registered, and alive, until close()."""
        buffer = page_aligned(nbytes)
        size = buffer.numel()
        cudart = torch.cuda.cudart()
        error = cudart.cudaHostRegister(buffer.data_ptr(), size, 0)
        if error != cudart.cudaError.success:
            raise RuntimeError(f"offload: pinning {size} bytes of host memory failed ({error})")
        self._registered.append(buffer)
        return buffer[:nbytes]

    def close(self) -> None:
        """Unpin every host buffer, once no copy can still use them."""
        for stream in (self._to_host_stream, self._to_device_stream):
            stream.synchronize()
        cudart = torch.cuda.cudart()
        for buffer in self._registered:
            cudart.cudaHostUnregister(buffer.data_ptr())
        self._registered.clear()

    def current_stream(self) -> torch.cuda.Stream:
        # Looked up at every use: autograd runs backward nodes on the stream of their forward op,
        # and a caller may compute on a stream of its own.
        return torch.cuda.current_stream(self.device)

    def ready_event(self) -> torch.cuda.Event:
        """Marks all work enqueued so far on the compute stream (the saved tensor's producer)."""
        event = torch.cuda.Event()
        event.record(self.current_stream())
        return event

    def allocate_device(self, nbytes: int, stream: torch.cuda.Stream
                        ) -> tuple[Tensor, torch.cuda.Event]:
        """A device buffer owned by `stream` (the consumer's), so that freeing it later is
        ordered after the consumer's use. The event marks the allocation: memory just freed on
        `stream` may still be read by its pending kernels, so a copy into it must wait."""
        with torch.cuda.stream(stream):
            tensor = torch.empty(nbytes, dtype=torch.uint8, device=self.device)
            allocated = torch.cuda.Event()
            allocated.record(stream)
        return tensor, allocated

    def to_host(self, src: Tensor, dst: Tensor, after: Sequence[Optional[Event]]) -> Event:
        return self._copy(self._to_host_stream, src, dst, after)

    def to_device(self, src: Tensor, dst: Tensor, after: Sequence[Optional[Event]]) -> Event:
        return self._copy(self._to_device_stream, src, dst, after)

    def wait(self, event: Optional[Event]) -> None:
        if event is not None:
            self.current_stream().wait_event(event)

    def _copy(self, stream: torch.cuda.Stream, src: Tensor, dst: Tensor,
              after: Sequence[Optional[Event]]) -> torch.cuda.Event:
        with torch.cuda.stream(stream):
            for event in after:
                if event is not None:
                    stream.wait_event(event)
            if self._delay is not None:
                self._delay()
            dst.copy_(src, non_blocking=True)
            # Blocking: threads that synchronize on it sleep instead of spinning.
            done = torch.cuda.Event(blocking=True)
            done.record(stream)
        # Freed in stream order: the allocator reuses their blocks only after this stream's work
        # queued by the time they are freed, this copy included (see the module's docstring).
        for tensor in (src, dst):
            if tensor.is_cuda:
                tensor.record_stream(stream)
        return done


class HoldUntil:
    """Callbacks deferred until an event has completed."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._items: list[tuple[Optional[Event], Callable[[], None]]] = []

    def add(self, event: Optional[Event], then: Callable[[], None]) -> None:
        with self._lock:
            self._items.append((event, then))

    def reap(self) -> None:
        """Run the callbacks of completed copies; never waits."""
        with self._lock:
            done, pending = [], []
            for item in self._items:
                (done if item[0] is None or item[0].query() else pending).append(item)
            self._items = pending
        self._finish(done)

    def drain(self) -> None:
        """Wait for every copy, then run every callback."""
        with self._lock:
            items, self._items = self._items, []
        for event, _ in items:
            if event is not None:
                event.synchronize()
        self._finish(items)

    def __len__(self) -> int:
        with self._lock:
            return len(self._items)

    @staticmethod
    def _finish(items: list) -> None:
        # Callbacks run outside the lock: they take other locks (the pool's).
        for _, then in items:
            then()


def size_class(nbytes: int) -> int:
    """The pool's buffer for nbytes: nbytes rounded up to a page, what pinning really locks.
    Blocks of one model save the same sizes every step, so exact classes are reused as well as
    power-of-two ones would be, without pinning up to twice the bytes."""
    return max(PAGE_BYTES, -(-nbytes // PAGE_BYTES) * PAGE_BYTES)


def page_aligned(nbytes: int) -> Tensor:
    """Ordinary host memory of size_class(nbytes) bytes starting on a page boundary, so that
    pinning it locks exactly its own pages (the one spare page of the backing stays pageable)."""
    size = size_class(nbytes)
    backing = torch.empty(size + PAGE_BYTES, dtype=torch.uint8)
    start = -backing.data_ptr() % PAGE_BYTES
    return backing[start:start + size]


class HostSlot:
    """A pool buffer lent out; `buffer` is uint8 of at least the size asked for."""

    __slots__ = ("buffer", "size")

    def __init__(self, buffer: Tensor, size: int) -> None:
        self.buffer, self.size = buffer, size


class PinnedPool:
    """Host buffers in size classes of the exact sizes asked for (to a page), bounded by
    max_bytes in all.

    Buffers are allocated on first need and then reused: in steady state (the same shapes every
    step) no allocation happens after the first step, and a class holds as many buffers as the
    step had storages of that size in flight at once (the planner counts exactly these:
    trainer/preflight/host_memory.py). Nothing is freed to make room for another class:
    unpinning and pinning again costs more than the copies it serves, and a freed block would
    have to wait for every copy into it. When a class has no free buffer and the bound is
    reached, `acquire` returns None and the caller decides (keep on the device, or wait for a
    release).
    """

    def __init__(self, max_bytes: int, allocate: Callable[[int], Tensor]) -> None:
        self.max_bytes = max_bytes
        self._allocate = allocate
        self._free: dict[int, list[Tensor]] = {}
        self._lock = threading.Lock()
        self.allocated_bytes = 0
        self.in_use_bytes = 0
        self.allocations = 0

    def acquire(self, nbytes: int) -> Optional[HostSlot]:
        size = size_class(nbytes)
        with self._lock:
            free = self._free.get(size)
            if free:
                buffer = free.pop()
            elif self.allocated_bytes + size <= self.max_bytes:
                buffer = self._allocate(size)
                self.allocations += 1
                self.allocated_bytes += size
            else:
                return None
            self.in_use_bytes += size
            return HostSlot(buffer, size)

    def release(self, slot: HostSlot) -> None:
        with self._lock:
            self.in_use_bytes -= slot.size
            self._free.setdefault(slot.size, []).append(slot.buffer)


def copy_out_staged(copier: Copier, source: Tensor, ready: Optional[Event],
                    staging: Sequence[Tensor], chunk_bytes: int,
                    consume: Callable[[Tensor], None]) -> None:
    """Device -> two pinned buffers in turn -> consume (e.g. a file write), chunk by chunk:
    chunk k+1 is being copied while chunk k is consumed."""
    bounds = [(lo, min(lo + chunk_bytes, source.numel()))
              for lo in range(0, source.numel(), chunk_bytes)]

    def copy(k: int) -> Event:
        lo, hi = bounds[k]
        return copier.to_host(source[lo:hi], staging[k % 2][:hi - lo], after=[ready])

    pending = [copy(k) for k in range(min(2, len(bounds)))]
    for k, (lo, hi) in enumerate(bounds):
        pending[k].synchronize()
        consume(staging[k % 2][:hi - lo])
        if k + 2 < len(bounds):
            pending.append(copy(k + 2))  # its buffer was just consumed


def copy_in_staged(copier: Copier, restored: Tensor, allocated: Optional[Event],
                   staging: Sequence[Tensor], in_use: list[Optional[Event]], chunk_bytes: int,
                   produce: Callable[[Tensor], None]) -> Optional[Event]:
    """produce (e.g. a file read) -> two pinned buffers in turn -> device, chunk by chunk: chunk
    k is produced while chunk k-1 is copied. `in_use` carries, across calls, the last copy out of
    each buffer. Returns the last copy's event, which covers all (one stream, in order)."""
    done = None
    for k, lo in enumerate(range(0, restored.numel(), chunk_bytes)):
        hi = min(lo + chunk_bytes, restored.numel())
        if in_use[k % 2] is not None:
            in_use[k % 2].synchronize()  # its previous copy must have read it
        produce(staging[k % 2][:hi - lo])
        done = copier.to_device(staging[k % 2][:hi - lo], restored[lo:hi], after=[allocated])
        in_use[k % 2] = done
    return done
