"""Offload with asynchronous copies: the CPU store's pinned pool and the disk store's staging.

The first half runs everywhere: `ThreadCopier` stands in for CUDA side streams (copies run later,
in order, on a background thread), so the stores' asynchronous bookkeeping - pool slots, what is
held until which copy finished, pool-full fallback, chunked staging - is exercised on CPU.
The second half (`cuda` marker) runs the same on a GPU with real streams and injected delays.
"""

from __future__ import annotations

import queue
import threading
import time
from typing import Optional, Sequence

import pytest
import torch

from offload.cuda import PinnedPool, size_class
from offload.disk import DiskStore
from offload.engine import OffloadError
from offload.host import CpuStore
from tests.test_offload_engine import INPLACE_ERROR, Toy, _inplace_outcome, assert_bitwise, train


class _ThreadEvent:
    def __init__(self) -> None:
        self._done = threading.Event()

    def query(self) -> bool:
        return self._done.is_set()

    def synchronize(self) -> None:
        self._done.wait()


class ThreadCopier:
    """CUDA side streams, played on the CPU: copies run one at a time on a background thread,
    each after `delay_s`, so they finish well after the call that asked for them."""

    def __init__(self, delay_s: float = 0.0) -> None:
        self.device = torch.device("cpu")
        self.delay_s = delay_s
        self.host_allocations = 0
        self._jobs: queue.Queue = queue.Queue()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def allocate_host(self, nbytes: int) -> torch.Tensor:
        self.host_allocations += 1
        return torch.empty(nbytes, dtype=torch.uint8)

    def current_stream(self) -> None:
        return None

    def ready_event(self) -> None:
        return None  # the CPU "compute stream" is the calling thread: done already

    def allocate_device(self, nbytes: int, stream: object) -> tuple[torch.Tensor, None]:
        return torch.empty(nbytes, dtype=torch.uint8), None

    def to_host(self, src: torch.Tensor, dst: torch.Tensor, after: Sequence) -> _ThreadEvent:
        return self._enqueue(src, dst, after)

    def to_device(self, src: torch.Tensor, dst: torch.Tensor, after: Sequence) -> _ThreadEvent:
        return self._enqueue(src, dst, after)

    def wait(self, event: Optional[_ThreadEvent]) -> None:
        if event is not None:
            event.synchronize()

    def close(self) -> None:
        self._jobs.put(None)
        self._thread.join()

    def _enqueue(self, src, dst, after) -> _ThreadEvent:
        done = _ThreadEvent()
        self._jobs.put((src, dst, [e for e in after if e is not None], done))
        return done

    def _run(self) -> None:
        while (job := self._jobs.get()) is not None:
            src, dst, after, done = job
            for event in after:
                event.synchronize()
            time.sleep(self.delay_s)
            dst.copy_(src)
            done._done.set()
            del src, dst, job


def test_size_classes_and_pool_bound() -> None:
    assert [size_class(n) for n in (1, 4096, 4097, 5000, 1 << 20)] == [4096, 4096, 8192, 8192,
                                                                       1 << 20]
    allocated = []
    pool = PinnedPool(3 * 8192, lambda n: allocated.append(n) or torch.empty(n, dtype=torch.uint8))
    a, b, c = pool.acquire(5000), pool.acquire(8000), pool.acquire(100)
    assert a.size == b.size == 8192 and c.size == 4096 and pool.acquire(5000) is None
    pool.release(a)
    again = pool.acquire(6000)
    assert again.buffer is a.buffer and allocated == [8192, 8192, 4096]
    assert pool.allocated_bytes == 20480 <= pool.max_bytes and pool.in_use_bytes == 20480


@pytest.mark.parametrize("recompute", [False, True], ids=["keep", "checkpoint"])
def test_pinned_pool_store_bitwise_and_stops_allocating(recompute: bool) -> None:
    ref, _ = train(None, recompute, steps=4)
    copier = ThreadCopier(delay_s=0.001)
    store = CpuStore("cpu", max_host_bytes=1 << 30, copier=copier)
    allocations = []
    grads, stats = train(store, recompute, steps=4,
                         after_step=lambda step: allocations.append(copier.host_allocations))
    copier.close()
    assert_bitwise(grads, ref)
    assert store.moves_data and all(s.moved_count > 0 for s in stats)
    assert allocations[0] > 0 and len(set(allocations)) == 1  # none after the first step
    assert store.pool.in_use_bytes == 0 and store.fallback_count == 0
    assert store.ready_gets + store.waited_gets > 0


def test_full_pool_keeps_tensors_on_the_device_and_stays_correct(caplog) -> None:
    ref, _ = train(None, False)
    # One block's saves (52 KiB in size classes) fit, the four blocks' do not.
    store = CpuStore("cpu", max_host_bytes=64 << 10, copier=ThreadCopier(delay_s=0.001))
    grads, stats = train(store, False)
    assert_bitwise(grads, ref)
    assert all(s.fallback_count > 0 and s.moved_count > 0 for s in stats)
    assert store.pool.allocated_bytes <= 64 << 10
    assert sum("pinned pool is full" in r.getMessage() for r in caplog.records) == 1


def test_block_larger_than_the_pool_is_a_clear_error() -> None:
    store = CpuStore("cpu", max_host_bytes=16 << 10, copier=ThreadCopier())
    with pytest.raises(OffloadError, match="^offload.max_host_bytes: block 0 alone saves"):
        train(store, False, steps=1)


def test_in_place_write_racing_a_late_copy_raises_as_without_offload() -> None:
    store = CpuStore("cpu", max_host_bytes=1 << 30, copier=ThreadCopier(delay_s=0.01))
    # The copy runs after `y.mul_(3)` and so copies the overwritten data: the check refuses it.
    got = _inplace_outcome(store, "illegal")
    assert isinstance(got, str) and got.startswith(INPLACE_ERROR), got


@pytest.mark.parametrize("chunk_bytes", [4096, 1 << 20], ids=["chunked", "whole"])
def test_disk_store_through_staging_buffers_bitwise(chunk_bytes: int, tmp_path) -> None:
    ref, _ = train(None, False)
    copier = ThreadCopier(delay_s=0.0005)
    store = DiskStore(str(tmp_path), "cpu", max_inflight_bytes=32 << 10, copier=copier,
                      chunk_bytes=chunk_bytes)
    grads, _ = train(store, False)
    copier.close()
    assert_bitwise(grads, ref)
    assert copier.host_allocations == 4  # two staging buffers per thread, nothing per tensor
    assert store.bytes_written > 0 and list(tmp_path.iterdir()) == []


# --- on a GPU ---------------------------------------------------------------------------------

def _sleep_on_side_stream(cycles: int):
    return lambda: torch.cuda._sleep(cycles)


def _cuda_reference(recompute: bool):
    ref, _ = train(None, recompute, device="cuda")
    again, _ = train(None, recompute, device="cuda")
    assert_bitwise(again, ref)  # the baseline itself is deterministic on this GPU
    return ref


@pytest.mark.cuda
@pytest.mark.parametrize("recompute", [False, True], ids=["keep", "checkpoint"])
def test_cuda_pinned_store_bitwise_with_delayed_copies(recompute: bool) -> None:
    ref = _cuda_reference(recompute)
    store = CpuStore("cuda", max_host_bytes=64 << 20,
                     side_stream_delay=_sleep_on_side_stream(2_000_000))
    allocations = []
    grads, stats = train(store, recompute, steps=4, device="cuda",
                         after_step=lambda step: allocations.append(store.pool.allocations))
    assert_bitwise(grads, ref)
    assert all(s.moved_count > 0 and s.fallback_count == 0 for s in stats)
    assert allocations[0] > 0 and len(set(allocations)) == 1  # no pinned allocation after step 1
    assert store.pool.allocated_bytes <= 64 << 20 and store.pool.in_use_bytes == 0


@pytest.mark.cuda
def test_cuda_pool_full_falls_back_and_stays_bitwise() -> None:
    ref = _cuda_reference(False)
    store = CpuStore("cuda", max_host_bytes=64 << 10,
                     side_stream_delay=_sleep_on_side_stream(1_000_000))
    grads, stats = train(store, False, device="cuda")
    assert_bitwise(grads, ref)
    assert all(s.fallback_count > 0 for s in stats) and store.pool.allocated_bytes <= 64 << 10


@pytest.mark.cuda
def test_cuda_prefetch_overlaps_backward() -> None:
    # Bigger activations and many blocks: a block's backward takes longer than one copy back.
    def make_model():
        return Toy(8)

    store = CpuStore("cuda", max_host_bytes=256 << 20)
    train(store, True, steps=2, device="cuda", make_model=make_model)
    # Gets of blocks 0..6 find their copy already finished (started one block ahead); the last
    # block's own copy is started by its first unpack and has to be waited for.
    assert store.ready_gets > 0 and store.waited_gets >= 1, (store.ready_gets, store.waited_gets)


@pytest.mark.cuda
def test_cuda_disk_store_bitwise_with_delayed_copies(tmp_path) -> None:
    ref = _cuda_reference(False)
    store = DiskStore(str(tmp_path), "cuda", max_inflight_bytes=64 << 10, chunk_bytes=4096,
                      side_stream_delay=_sleep_on_side_stream(1_000_000))
    grads, _ = train(store, False, device="cuda")
    assert_bitwise(grads, ref)
    assert list(tmp_path.iterdir()) == []


@pytest.mark.cuda
def test_cuda_in_place_write_racing_the_copy_raises() -> None:
    assert _inplace_outcome(None, "illegal", device="cuda").startswith(INPLACE_ERROR)
    # ~25 ms of side-stream sleep before each copy: `y.mul_(3)` runs before y is copied.
    store = CpuStore("cuda", max_host_bytes=64 << 20,
                     side_stream_delay=_sleep_on_side_stream(50_000_000))
    got = _inplace_outcome(store, "illegal", device="cuda")
    assert isinstance(got, str) and got.startswith(INPLACE_ERROR), got
