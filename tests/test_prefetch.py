"""Reading batches ahead in threads (trainer/data/prefetch.py) changes when a batch is read, never
what it is."""

from __future__ import annotations


def test_prefetcher_returns_what_read_returns_and_reads_ahead_in_threads() -> None:
    import threading

    from trainer.data.prefetch import Prefetcher

    readers: dict[int, str] = {}

    def read(index: int) -> list[int]:
        readers[index] = threading.current_thread().name
        return [index, index * index]

    order = [0, 1, 2, 3, 9, 10, 2, 3, 4]  # a resume-like jump forward and a rollback back
    prefetcher = Prefetcher(read, workers=2)
    assert [prefetcher.get(i) for i in order] == [[i, i * i] for i in order]
    main = threading.current_thread().name
    for index in (1, 3, 10, 4):  # read ahead by the data threads
        assert readers[index].startswith("blocktrain-data"), (index, readers[index])
    assert readers[9] == readers[2] == main  # after a jump: read in place
    prefetcher.close()
    inline = Prefetcher(read, workers=0)
    assert inline.get(20) == [20, 400] and readers[20] == threading.current_thread().name
    assert 21 not in readers
