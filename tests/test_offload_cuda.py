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
import weakref
from typing import Optional, Sequence

import pytest
import torch

from offload.cuda import CudaCopier, PinnedPool, size_class
from offload.disk import DiskStore
from offload.engine import OffloadError, Offloader
from offload.host import CpuStore
from tests.test_offload_engine import (INPLACE_ERROR, MIN_BYTES, Block, Toy, _inplace_outcome,
                                       assert_bitwise, batch, train, wrap_blocks)


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


class _Done:
    def query(self) -> bool:
        return True

    def synchronize(self) -> None:
        pass


class InlineCopier:
    """Copies at once and holds nothing, as the CUDA copier holds nothing (it records the copy's
    stream on device memory instead): whatever still holds a tensor afterwards is the store."""

    device = torch.device("cpu")

    def allocate_host(self, nbytes: int) -> torch.Tensor:
        return torch.empty(nbytes, dtype=torch.uint8)

    def current_stream(self) -> None:
        return None

    def ready_event(self) -> None:
        return None

    def allocate_device(self, nbytes: int, stream: object) -> tuple[torch.Tensor, None]:
        return torch.empty(nbytes, dtype=torch.uint8), None

    def to_host(self, src: torch.Tensor, dst: torch.Tensor, after: Sequence) -> _Done:
        dst.copy_(src)
        return _Done()

    to_device = to_host

    def wait(self, event: Optional[_Done]) -> None:
        pass


def test_size_classes_are_the_sizes_asked_for_to_a_page_and_the_pool_is_bounded() -> None:
    assert [size_class(n) for n in (1, 4096, 4097, 5000, 5 << 30)] == [4096, 4096, 8192, 8192,
                                                                       5 << 30]
    allocated = []
    pool = PinnedPool(3 * 8192, lambda n: allocated.append(n) or torch.empty(n, dtype=torch.uint8))
    a, b, c = pool.acquire(5000), pool.acquire(8000), pool.acquire(100)
    assert a.size == b.size == 8192 and c.size == 4096 and pool.acquire(5000) is None
    pool.release(a)
    again = pool.acquire(6000)
    assert again.buffer is a.buffer and allocated == [8192, 8192, 4096]
    assert pool.allocated_bytes == 20480 <= pool.max_bytes and pool.in_use_bytes == 20480


def test_pool_of_uniform_block_storages_pins_their_exact_bytes_and_reuses_them() -> None:
    """Three steps of 4 blocks, each saving storages of 5 GiB + 4 KiB and 12,288 bytes (no power
    of two): the pool pins their sum (not 8 GiB per big one), all in the first step."""
    sizes = [(5 << 30) + 4096, 12288] * 4
    allocated = []
    pool = PinnedPool(1 << 40, lambda n: allocated.append(n) or n)  # no real memory
    for _ in range(3):
        slots = [pool.acquire(n) for n in sizes]  # all out by the forward's end
        assert [s.size for s in slots] == sizes
        for slot in reversed(slots):  # back in backward
            pool.release(slot)
    assert allocated == sizes and pool.allocated_bytes == sum(sizes) and pool.in_use_bytes == 0


def test_host_buffers_start_on_a_page_so_pinning_locks_only_their_own_pages() -> None:
    from offload.cuda import PAGE_BYTES, page_aligned

    for n in (1, 4096, 10_000, 1 << 20):
        buffer = page_aligned(n)
        assert buffer.data_ptr() % PAGE_BYTES == 0 and buffer.numel() == size_class(n) >= n


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


def test_store_keeps_no_device_memory_alive_once_its_copy_is_queued() -> None:
    """Freed in stream order (issue 29, item 4): the source of a copy to the host and the buffer
    a copy brought back go as soon as nothing else holds them, not when the CPU next sees the
    copy's event done (on a GPU the CPU runs far ahead of the copies)."""
    store = CpuStore("cpu", max_host_bytes=1 << 20, copier=InlineCopier())
    flat = torch.randint(0, 255, (8192,), dtype=torch.uint8)
    expected = flat.clone()
    ticket = store.put(flat, group=0)
    source = weakref.ref(flat)
    del flat
    assert source() is None
    store.prefetch(ticket)
    restored = store.get(ticket)
    assert torch.equal(restored, expected)
    back = weakref.ref(restored)
    del restored
    store.release(ticket)
    assert back() is None
    store.end_step()
    assert store.pool.in_use_bytes == 0


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


class _SlowBackward(torch.autograd.Function):
    """Identity; its backward sleeps on the compute stream (~0.5 ms), so a block's backward
    outlasts by far the copy back of an 8 KiB saved input."""

    @staticmethod
    def forward(ctx, x: torch.Tensor) -> torch.Tensor:
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> torch.Tensor:
        torch.cuda._sleep(1_000_000)
        return grad


class _SlowBlock(Block):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(_SlowBackward.apply(x))


class TimingCopier(CudaCopier):
    """The CUDA copier, with a timing event after every copy back and one where the compute
    stream reaches each wait for a copy back, to order them on the GPU's own clock."""

    def __init__(self, device: torch.device) -> None:
        super().__init__(device)
        self.copied_back: dict[int, tuple] = {}  # id(done event) -> (done, timing event)
        self.waits: list[tuple] = []  # (timing event after the copy, where compute arrived)

    def to_device(self, src, dst, after):
        done = super().to_device(src, dst, after)
        mark = torch.cuda.Event(enable_timing=True)
        mark.record(self._to_device_stream)
        self.copied_back[id(done)] = (done, mark)
        return done

    def wait(self, event) -> None:
        arrived = torch.cuda.Event(enable_timing=True)
        arrived.record(self.current_stream())
        self.waits.append((self.copied_back[id(event)][1], arrived))
        super().wait(event)


@pytest.mark.cuda
def test_cuda_prefetch_overlaps_backward() -> None:
    """Issue 29, item 12: judged by the order of events on the GPU, not by whether the CPU
    happened to find a copy finished. Every block but the first to run backward (the last,
    whose copy starts at its own first unpack) must find its input back on the device by the
    time the compute stream reaches it: the copy ran beside the next block's backward."""
    blocks = 8
    copier = TimingCopier(torch.device("cuda", torch.cuda.current_device()))
    store = CpuStore("cuda", max_host_bytes=256 << 20, copier=copier)
    per_step = []
    train(store, True, steps=2, device="cuda", make_model=lambda: Toy(blocks, _SlowBlock),
          after_step=lambda step: per_step.append(len(copier.waits)))
    torch.cuda.synchronize()
    starts = [0, *per_step[:-1]]
    for start, end in zip(starts, per_step):
        waits = copier.waits[start:end]
        assert len(waits) == blocks, len(waits)  # one saved input per recomputed block
        # elapsed_time: milliseconds from the copy's end to the compute stream's arrival.
        lateness = [copied.elapsed_time(arrived) for copied, arrived in waits[1:]]
        assert min(lateness) >= 0, lateness


@pytest.mark.cuda
def test_cuda_offload_lowers_the_forward_peak_while_copies_lag() -> None:
    """Issue 29, item 4: with every copy to the host held back ~25 ms on its side stream (the
    CPU far ahead of the copies, as at a large model's loss head), what offload moved is no
    longer allocated at the end of forward. Held until the CPU saw each copy done, it was."""
    blocks = 8

    def forward_peak(store) -> int:
        torch.manual_seed(0)
        model = Toy(blocks).to("cuda")
        offloader = Offloader(store, MIN_BYTES) if store is not None else None
        wrap_blocks(model.blocks, offloader, recompute=True)
        x = batch(0, "cuda")
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        if offloader:
            offloader.begin_step()
        loss = model(x)
        peak = torch.cuda.max_memory_allocated() - base
        loss.backward()
        if offloader:
            offloader.close()
        return peak

    plain = forward_peak(None)
    store = CpuStore("cuda", max_host_bytes=64 << 20,
                     side_stream_delay=_sleep_on_side_stream(50_000_000))
    offloaded = forward_peak(store)
    block_input = batch(0).numel() * 4
    # Blocks 1..7 saved their inputs (block 0's is the caller's batch): at least 5 of them gone.
    assert plain - offloaded >= 5 * block_input, (plain, offloaded, block_input)


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
