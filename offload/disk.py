"""offload.target=disk: saved storages wait in files between forward and backward.

One file per stored storage, in a folder of this process's own under `offload.dir`. One file per
storage (rather than one append-only file per step) lets each file go the moment its data is back,
so the disk holds only what backward has not reached yet; the per-file cost is nothing next to
activation sizes of megabytes and more.

A writer thread writes what `put` queues; `put` blocks only while `max_inflight_bytes` already
wait to be written. Once written, the store drops its reference, so a storage nobody else holds is
freed (on the CPU that is the point: resident memory goes down). A reader thread reads back in the
order `prefetch` asks, i.e. one block ahead of backward; files are deleted as soon as their data is
back. On CUDA both threads go through two pinned staging buffers each (chunk by chunk, the copy of
one chunk overlapping the file I/O of the other), so pinned memory stays at 4 x chunk_bytes.

On the CPU, data comes back as a private mapping of its file (see `map_private`), and with
`trim_heap` the heap's free pages go back to the system when backward starts (`offload.heap`):
without both, resident memory stays at its high-water mark whatever was offloaded.
"""

from __future__ import annotations

import errno
import functools
import os
import queue
import secrets
import shutil
import threading
from typing import Callable, Optional

import torch
from torch import Tensor

from offload.cuda import (Copier, CudaCopier, Event, copy_in_staged,
                          copy_out_staged)
from offload.engine import OffloadError, resolve_device
from offload.files import (FOLDER_PREFIX, check_writable, cleanup_stale, hold, host_tag,
                           map_private, read_into, write_all)
from offload.heap import release_free_heap

__all__ = ["DiskStore", "FOLDER_PREFIX", "check_writable", "cleanup_stale", "host_tag"]

class _DiskTicket:
    __slots__ = ("nbytes", "path", "source", "ready", "writing", "on_disk", "released",
                 "restored", "restored_ready", "read_queued", "reading", "consumer", "error")
    kept_on_device = False

    def __init__(self, nbytes: int, path: str, source: Tensor, ready: Optional[Event]) -> None:
        self.nbytes, self.path = nbytes, path
        self.source: Optional[Tensor] = source  # until written
        self.ready = ready  # marks the source's producer on the compute stream (CUDA)
        self.writing = self.on_disk = self.released = False
        self.read_queued = self.reading = False
        self.restored: Optional[Tensor] = None
        self.restored_ready: Optional[Event] = None
        self.consumer: object = None  # the stream that will use the data back
        self.error: Optional[OffloadError] = None


class DiskStore:
    """Files under `dir` for saved storages.

    device: the compute device. max_inflight_bytes: bytes queued for writing before `put` blocks.
    copier: how bytes reach host memory on a device (default: CUDA side streams); None on CPU.
    chunk_bytes: size of each pinned staging buffer (device only). trim_heap (CPU only): give the
    heap's free pages back to the system once per micro-batch, when backward starts. before_write:
    run on the writer thread before each file (tests inject delays or failures through it).
    """

    def __init__(self, dir: str, device: torch.device | str, max_inflight_bytes: int = 256 << 20,
                 copier: Optional[Copier] = None, chunk_bytes: int = 64 << 20,
                 trim_heap: bool = False,
                 side_stream_delay: Optional[Callable[[], None]] = None,
                 before_write: Optional[Callable[[], None]] = None) -> None:
        self.device = resolve_device(device)
        self._owns_copier = copier is None  # a CUDA copier made here is closed here
        if copier is None and self.device.type == "cuda":
            copier = CudaCopier(self.device, side_stream_delay)
        self._copier = copier
        self.moves_data = True
        self.max_inflight_bytes, self.chunk_bytes = max_inflight_bytes, chunk_bytes
        self._before_write = before_write
        self.trim_heap = trim_heap and self._copier is None
        self.heap_trims = 0
        check_writable(dir, 0)
        self.removed_stale = cleanup_stale(dir)
        self.folder = os.path.join(dir, f"{FOLDER_PREFIX}{host_tag()}-{os.getpid()}-"
                                        f"{secrets.token_hex(4)}")
        # Made and locked under a name the cleaners of other ranks sharing `dir` skip, then
        # renamed (the lock stays with the folder): no one ever sees it unlocked.
        staging = os.path.join(dir, "." + os.path.basename(self.folder))
        os.makedirs(staging)
        self._held = hold(staging)  # until close, or until this process ends in any way
        os.rename(staging, self.folder)
        self._cond = threading.Condition()
        self._live: dict[int, _DiskTicket] = {}  # by id(ticket): not yet released
        self._next_file = 0
        self._inflight = self._pending_writes = self._pending_reads = 0
        self._error: Optional[OffloadError] = None
        self._closed = False
        self.bytes_written = self.bytes_read = self.served_before_write = 0
        self.peak_inflight_bytes = 0
        self._writes: queue.Queue = queue.Queue()
        self._reads: queue.Queue = queue.Queue()
        self._writer = threading.Thread(target=self._write_loop, daemon=True,
                                        name="blocktrain-offload-writer")
        self._reader = threading.Thread(target=self._read_loop, daemon=True,
                                        name="blocktrain-offload-reader")
        self._writer.start()
        self._reader.start()

    # --- Store ---------------------------------------------------------------------------

    def put(self, flat: Tensor, group: int) -> _DiskTicket:
        nbytes = flat.numel()
        ready = self._copier.ready_event() if self._copier is not None else None
        with self._cond:
            if self._closed:
                raise RuntimeError("offload: DiskStore.put after close()")
            if self._error is not None:
                raise self._error
            # One storage larger than the bound still goes when nothing else waits.
            self._wait(lambda: self._inflight == 0
                       or self._inflight + nbytes <= self.max_inflight_bytes)
            path = os.path.join(self.folder, f"{self._next_file}.bin")
            self._next_file += 1
            ticket = _DiskTicket(nbytes, path, flat, ready)
            self._live[id(ticket)] = ticket
            self._inflight += nbytes
            self.peak_inflight_bytes = max(self.peak_inflight_bytes, self._inflight)
            self._pending_writes += 1
        self._writes.put(ticket)
        return ticket

    def prefetch(self, ticket: _DiskTicket) -> None:
        with self._cond:
            if ticket.restored is None and not ticket.released and ticket.error is None:
                self._queue_read(ticket)

    def get(self, ticket: _DiskTicket) -> Tensor:
        with self._cond:
            if ticket.restored is None and ticket.source is not None:
                # Not written yet: serve it from memory; the file goes once written.
                ticket.restored = ticket.source
                self.served_before_write += 1
            elif ticket.restored is None:
                self._queue_read(ticket)
                self._wait(lambda: ticket.restored is not None or ticket.error is not None)
            if ticket.error is not None:
                raise ticket.error
            restored, ready = ticket.restored, ticket.restored_ready
        if self._copier is not None:
            self._copier.wait(ready)
        return restored

    def release(self, ticket: _DiskTicket) -> None:
        with self._cond:
            self._release(ticket)

    def poll(self) -> None:
        pass  # nothing waits on a copy: the copier frees device buffers in stream order

    def backward_started(self) -> None:
        # Forward's offloaded activations have been freed into the heap by now (a bounded
        # amount may still wait for the writer); backward must not stack its memory on top.
        if self.trim_heap and release_free_heap():
            self.heap_trims += 1

    def flush(self) -> None:
        """Wait until everything queued has been written."""
        with self._cond:
            self._wait(lambda: self._pending_writes == 0, raise_error=False)

    def end_step(self) -> None:
        """Release what is left, finish the threads' work, check no file or memory leaked."""
        with self._cond:
            for ticket in list(self._live.values()):
                self._release(ticket)
            self._wait(lambda: self._pending_writes == 0 and self._pending_reads == 0,
                       raise_error=False)
            inflight = self._inflight
        # The folder can vanish under us (someone cleaned offload.dir): the step has failed
        # already, with that error; do not bury it under another.
        leftovers = os.listdir(self.folder) if os.path.isdir(self.folder) else []
        for name in leftovers:
            os.remove(os.path.join(self.folder, name))
        if leftovers or inflight:
            raise RuntimeError(f"offload: DiskStore leaked files {leftovers} and {inflight} "
                               "bytes waiting to be written")

    def close(self) -> None:
        """Stop the threads and remove this process's folder; also after a failed step."""
        if self._closed:
            return
        self._closed = True
        try:
            if self._writer.is_alive() and self._reader.is_alive():
                self.end_step()
        finally:
            with self._cond:
                self._cond.notify_all()
            self._writes.put(None)
            self._reads.put(None)
            self._writer.join(timeout=60)
            self._reader.join(timeout=60)
            shutil.rmtree(self.folder, ignore_errors=True)
            os.close(self._held)
            if self._owns_copier and isinstance(self._copier, CudaCopier):
                self._copier.close()  # unpins the staging buffers

    def __enter__(self) -> "DiskStore":
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    # --- under self._cond ----------------------------------------------------------------

    def _wait(self, done: Callable[[], bool], raise_error: bool = True) -> None:
        """Wait for the threads; never forever: a dead thread or a failed write ends it."""
        while not done():
            if raise_error and self._error is not None:
                raise self._error
            if not (self._writer.is_alive() and self._reader.is_alive()):
                raise RuntimeError("offload: the disk store's I/O threads are not running "
                                   "(closed?)")
            self._cond.wait(timeout=1.0)

    def _queue_read(self, ticket: _DiskTicket) -> None:
        if ticket.read_queued:
            return
        ticket.read_queued = True
        ticket.consumer = self._copier.current_stream() if self._copier is not None else None
        self._pending_reads += 1
        self._reads.put(ticket)

    def _release(self, ticket: _DiskTicket) -> None:
        if ticket.released:
            return
        ticket.released = True
        del self._live[id(ticket)]
        self._drop_restored(ticket)
        if not ticket.writing:
            self._drop_source(ticket)  # queued, never to be written: free its memory now
        if ticket.on_disk and not ticket.reading:
            self._delete(ticket)

    def _drop_source(self, ticket: _DiskTicket) -> None:
        if ticket.source is not None:
            ticket.source = None
            self._inflight -= ticket.nbytes
            self._cond.notify_all()

    def _drop_restored(self, ticket: _DiskTicket) -> None:
        # If only prefetched, the copy to the device may still be writing into it: the copier
        # frees it in stream order, after that copy.
        ticket.restored = None

    def _delete(self, ticket: _DiskTicket) -> None:
        ticket.on_disk = False
        try:
            os.remove(ticket.path)
        except FileNotFoundError:
            pass

    # --- threads -------------------------------------------------------------------------

    def _write_loop(self) -> None:
        staging: list[Tensor] = []
        while (ticket := self._writes.get()) is not None:
            with self._cond:
                skip = ticket.released or ticket.restored is not None
                ticket.writing = not skip
                source = ticket.source
            error = None
            if not skip:
                try:
                    if self._before_write is not None:
                        self._before_write()
                    with open(ticket.path, "wb", buffering=0) as file:
                        if self._copier is None:
                            write_all(file, source)
                        else:
                            staging = staging or [self._copier.allocate_host(self.chunk_bytes)
                                                  for _ in range(2)]
                            copy_out_staged(self._copier, source, ticket.ready, staging,
                                            self.chunk_bytes, functools.partial(write_all, file))
                except Exception as exc:  # reported to the training thread, not lost here
                    error = exc
            del source
            with self._cond:
                ticket.writing = False
                self._drop_source(ticket)
                self._pending_writes -= 1
                if error is not None:
                    full = getattr(error, "errno", None) in (errno.ENOSPC, errno.EDQUOT)
                    ticket.error = self._error = OffloadError(
                        f"offload.dir: no space left in {os.path.dirname(self.folder)} while "
                        "offloading activations; point offload.dir at a larger disk, or "
                        "offload less (offload.keep_last, offload.min_bytes, a recomputing "
                        "checkpointing policy)" if full else
                        f"offload.dir: writing {ticket.path} failed: {error}")
                    self._delete(ticket)  # whatever part of it was written
                elif not skip:
                    ticket.on_disk = True
                    self.bytes_written += ticket.nbytes
                if ticket.on_disk and (ticket.released or ticket.restored is not None):
                    self._delete(ticket)
                self._cond.notify_all()

    def _read_loop(self) -> None:
        staging: list[Tensor] = []
        in_use: list[Optional[Event]] = [None, None]  # the last copy out of each staging buffer
        while (ticket := self._reads.get()) is not None:
            with self._cond:
                # Writes finish in queue order; this one's is at most a queue away.
                while not (ticket.on_disk or ticket.error or ticket.released
                           or ticket.restored is not None or self._closed):
                    self._cond.wait(timeout=1.0)
                go = ticket.on_disk and not ticket.released and ticket.restored is None
                ticket.reading = go
            result, error = (None, None), None
            if go:
                try:
                    staging = staging or ([self._copier.allocate_host(self.chunk_bytes)
                                           for _ in range(2)] if self._copier else [])
                    result = self._read(ticket, staging, in_use)
                except Exception as exc:  # reported to the training thread, not lost here
                    error = exc
            with self._cond:
                ticket.reading = False
                self._pending_reads -= 1
                if error is not None:
                    ticket.error = OffloadError(f"offload.dir: reading {ticket.path} failed: "
                                                f"{error}")
                elif go:
                    ticket.restored, ticket.restored_ready = result
                    self.bytes_read += ticket.nbytes
                    if ticket.released:
                        self._drop_restored(ticket)
                if ticket.on_disk and (ticket.released or ticket.restored is not None):
                    self._delete(ticket)  # the data is back: the file has done its job
                self._cond.notify_all()
            result = (None, None)

    def _read(self, ticket: _DiskTicket, staging: list[Tensor],
              in_use: list[Optional[Event]]) -> tuple[Tensor, Optional[Event]]:
        if self._copier is None:
            return map_private(ticket.path, ticket.nbytes), None
        with open(ticket.path, "rb", buffering=0) as file:
            restored, allocated = self._copier.allocate_device(ticket.nbytes, ticket.consumer)
            done = copy_in_staged(self._copier, restored, allocated, staging, in_use,
                                  self.chunk_bytes, functools.partial(read_into, file))
            return restored, done
