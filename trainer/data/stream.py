"""`data.streaming=true`: a corpus read as a stream (larger than the disk, or not worth a copy),
tokenized and packed as it arrives, nothing cached.

Each rank reads its own share of the records (`datasets.distributed.split_dataset_by_node`) and
packs its own windows, `micro_batch_size x grad_accum` per step, in stream order. Which windows
a rank trains on at step s is then a function of the stream, the world size and the per-rank
batch: resuming reads the stream again from its start and skips what the steps before s took,
so a resumed run sees exactly what an uninterrupted one would, on the same world size (another
world size splits the records differently, and is refused at resume). When the stream ends it
starts again. Conversations are packed best-fit within a buffer of `STREAM_BUFFER` at a time.
"""

from __future__ import annotations

import threading
from typing import Iterator, Optional

import numpy as np
import torch

from trainer.data.chat import IGNORE, ChatError, chat_tokens
from trainer.data.formats import FormatError, conversation, record_name
from trainer.data.packing import best_fit_bins, bin_window, concat_windows, fit_length
from trainer.data.sources import DataError, DocSettings, open_documents

STREAM_BUFFER = 512  # conversations packed together (best-fit) as they arrive
Batch = tuple[torch.Tensor, ...]


class StreamWindows:
    """This rank's packed windows of a streamed corpus, a step at a time: `read(step)` returns
    (micro-batches, (supervised, real) tokens of this rank's share)."""

    def __init__(self, path: str, tokenizer, settings: DocSettings, rank: int, world: int,
                 micro_batch_size: int, grad_accum: int) -> None:
        self.path, self.tokenizer, self.settings = path, tokenizer, settings
        self.rank, self.world = rank, world
        self.micro_batch_size, self.grad_accum = micro_batch_size, grad_accum
        self.seq_len = settings.seq_len
        self.pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else (
            tokenizer.eos_token_id or 0)
        self._lock = threading.Lock()  # read-ahead threads ask for steps in any order
        self._windows: Optional[Iterator] = None
        self._next_step = 0
        self._ready: dict[int, tuple[list[Batch], tuple[int, int]]] = {}

    def read(self, step: int) -> tuple[list[Batch], tuple[int, int]]:
        with self._lock:
            if step in self._ready:
                return self._ready.pop(step)
            if step < self._next_step or self._windows is None:  # a jump back, or the start
                self._restart(step)
            while self._next_step <= step:
                self._ready[self._next_step] = self._take()
                self._next_step += 1
            return self._ready.pop(step)

    def _restart(self, step: int) -> None:
        """Read the stream from its start and skip the windows of the steps before `step`."""
        self._windows, self._ready = self._endless(), {}
        per_step = self.micro_batch_size * self.grad_accum
        for _ in range(step * per_step):
            next(self._windows)
        self._next_step = step

    def _take(self) -> tuple[list[Batch], tuple[int, int]]:
        windows = [next(self._windows) for _ in range(self.micro_batch_size * self.grad_accum)]
        supervised = sum(int((w[1] != IGNORE).sum()) for w, _ in windows)
        real = sum(r for _, r in windows)
        batches = []
        for m in range(self.grad_accum):
            part = windows[m * self.micro_batch_size:(m + 1) * self.micro_batch_size]
            batches.append(tuple(torch.from_numpy(np.stack([w[row] for w, _ in part]))
                                 for row in range(3)))
        return batches, (supervised, real)

    def _endless(self) -> Iterator:
        while True:  # pass after pass over the stream
            produced = 0
            for window in self._pack(self._documents()):
                produced += 1
                yield window
            if produced == 0:
                raise DataError(f"data.path: the stream {self.path} gives rank {self.rank} of "
                                f"{self.world} no usable document")

    def _documents(self) -> Iterator[tuple[np.ndarray, np.ndarray]]:
        from datasets.distributed import split_dataset_by_node

        records = split_dataset_by_node(open_documents(self.path, self.settings.split,
                                                       streaming=True), self.rank, self.world)
        s = self.settings
        for record in records:
            if s.kind == "text":
                text = record.get(s.text_field)
                if not isinstance(text, str):
                    raise DataError(f"data.text_field: {s.text_field!r} is missing or not text "
                                    f"in a record of {self.path}")
                ids = list(self.tokenizer(text)["input_ids"]) + [self.tokenizer.eos_token_id]
                supervised = [True] * len(ids)
            else:
                where = record_name(self.path, None, record)
                try:
                    messages = conversation(record, s.format, s.messages_field, s.prompt_field,
                                            s.completion_field, where)
                    ids, supervised = chat_tokens(self.tokenizer, messages, s.train_on, where)
                except (ChatError, FormatError) as exc:
                    raise DataError(str(exc)) from None
            if len(ids) >= 2 and (s.kind == "text" or any(supervised[1:])):
                yield np.asarray(ids, dtype=np.int64), np.asarray(supervised, dtype=bool)

    def _pack(self, docs: Iterator) -> Iterator:
        if self.settings.kind == "text" and self.settings.packing:
            yield from concat_windows(docs, self.seq_len, self.pad_id)
            return
        buffer: list = []
        for doc in docs:
            buffer.append(doc)
            if len(buffer) == (STREAM_BUFFER if self.settings.packing else 1):
                yield from self._bins(buffer)
                buffer = []
        yield from self._bins(buffer)

    def _bins(self, docs: list) -> Iterator:
        kept = [fit_length(len(ids) - 1, self.seq_len, self.settings.overlong) for ids, _ in docs]
        bins = best_fit_bins(kept, self.seq_len)
        for b in sorted(bins, key=min):  # in the order their first document arrived
            yield bin_window([docs[i] for i in b], self.seq_len, self.pad_id)
