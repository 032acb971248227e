"""Reading the next batches in background threads while the current step computes.

A batch is a pure function of its data index (trainer/data/tokens.py's sampler), so reading ahead
cannot change what a step sees: `get(i)` returns exactly `read(i)`. Only the time moves: decoding
high-resolution images (Pillow and numpy release the GIL) overlaps the forward and backward.
After a jump (resume, rollback) the read-ahead is dropped and the batch is read in place.
"""

from __future__ import annotations

from concurrent.futures import Future, ThreadPoolExecutor
from typing import Callable, Generic, TypeVar

T = TypeVar("T")


class Prefetcher(Generic[T]):
    """`get(index)` = `read(index)`, with the next `workers` indices read ahead, one thread each.
    workers=0 reads in the calling thread, nothing ahead."""

    def __init__(self, read: Callable[[int], T], workers: int) -> None:
        if workers < 0:
            raise ValueError(f"data.workers must be >= 0, got {workers}")
        self._read = read
        self._workers = workers
        self._pool = (ThreadPoolExecutor(workers, thread_name_prefix="blocktrain-data")
                      if workers else None)
        self._ahead: dict[int, Future] = {}

    def get(self, index: int) -> T:
        if self._pool is None:
            return self._read(index)
        future = self._ahead.pop(index, None)
        if future is None:  # a jump: what was read ahead is not needed
            for stale in self._ahead.values():
                stale.cancel()
            self._ahead.clear()
        for ahead in range(index + 1, index + 1 + self._workers):
            if ahead not in self._ahead:
                self._ahead[ahead] = self._pool.submit(self._read, ahead)
        return future.result() if future is not None else self._read(index)

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True, cancel_futures=True)
            self._ahead.clear()
