"""`data=text` and `data=chat`: documents tokenized with a Hugging Face tokenizer and packed into
windows, either prepared once and cached (trainer/data/documents.py, read in the one seeded
global order) or, with `data.streaming=true`, read as a stream (trainer/data/stream.py).

A packed window holds a varying number of supervised targets, so the loss is their sum, which
the step divides by the count over the whole global batch (`sums_loss`)."""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Optional

from trainer.config import ConfigError, DataConfig, check_writable, require
from trainer.data.base import ModelFacts, Source

if TYPE_CHECKING:
    import torch

    from trainer.data.batches import Data, Sampling
    from trainer.faults import TimeoutWatchdog


def default_num_proc(local_ranks: int) -> int:
    """data.num_proc=null: the cores this process may run on, split across the node's ranks."""
    return max(1, len(os.sched_getaffinity(0)) // max(1, local_ranks))


class DocumentSource(Source):
    sums_loss = True

    def check_files(self, d: DataConfig, model: ModelFacts) -> None:
        """Where the documents are and which tokenizer reads them."""
        require(bool(d.path), "data.path", f"data={self.name} needs data.path=<jsonl or parquet "
                "file, folder, glob, saved dataset or dataset name>, or data.path=demo to try "
                "it on made-up ones")
        require(d.train_path is None, "data.train_path",
                f"data={self.name} reads data.path (data.train_path is for data=tokens and "
                "images)")
        require(bool(d.tokenizer or model.tokenizer), "data.tokenizer",
                f"data={self.name} needs a Hugging Face tokenizer: data.tokenizer=<folder or "
                "name> (model=hf with model.path uses the model's own)")
        require(0 < d.val_fraction < 1 or d.val_path is not None, "data.val_fraction",
                f"must be in (0, 1) when data.val_path is not set, got {d.val_fraction}")
        if d.cache_dir is not None:
            check_writable(d.cache_dir, "data.cache_dir")
        require(d.num_proc is None or (type(d.num_proc) is int and d.num_proc >= 1),
                "data.num_proc", f"must be a number of processes of at least 1 (or null: the "
                f"cores of this node split across its ranks), got {d.num_proc!r}")

    def run_tokenizer(self, d: DataConfig, own: Optional[str]) -> Optional[str]:
        return d.tokenizer or own

    def with_demo(self, d: DataConfig, own: Optional[str]) -> DataConfig:
        from trainer.data.demo import with_demo

        return with_demo(d, own, chats=self.name == "chat")

    def check_deep(self, d: DataConfig, model: ModelFacts) -> None:
        """The files are there and have the field, the tokenizer loads (with a chat template
        for chat) and fits the model's vocabulary. The first record is enough."""
        from trainer.data.sources import (check_fields, document_settings,
                                          first_record_fields, load_tokenizer)

        # A DataError's message starts with the setting to change (the caller names it).
        for path, key in ((d.path, "data.path"), (d.val_path, "data.val_path")):
            fields = first_record_fields(path, d.split, key) if path else None
            if fields is not None:
                check_fields(fields, document_settings(d), path)
        tokenizer = load_tokenizer(d.tokenizer or model.path, self.name)
        if len(tokenizer) > model.vocab_size:
            raise ConfigError(model.vocab_key, f"the tokenizer {d.tokenizer or model.path} "
                              f"has {len(tokenizer)} ids, more than the model's "
                              f"{model.vocab_size}")

    def prepared_supervised_share(self, d: DataConfig,
                                  model: ModelFacts) -> Optional[tuple[float, str]]:
        """The busiest window's share of learned targets in the prepared cache of these files,
        tokenizer and settings (the head's rows in the busiest micro-batch are at most that)."""
        from trainer.data.documents import prepared_folder, busiest_share
        from trainer.data.sources import document_settings

        folder = prepared_folder(d.path, d.val_path, d.tokenizer or model.path,
                                 document_settings(d), d.cache_dir)
        return None if folder is None else (busiest_share(folder, d.seq_len), folder)

    def datasets(self, d: DataConfig, model: ModelFacts, sampling: Sampling,
                 preprocess: Optional[dict] = None) -> tuple:
        from trainer.data.documents import text_datasets
        from trainer.data.sources import document_settings

        return text_datasets(d.path, d.val_path, d.tokenizer or model.path,
                             document_settings(d), d.cache_dir, model.vocab_size,
                             sampling.preparer, self._stream_share(sampling), model.vocab_key,
                             num_proc=d.num_proc or default_num_proc(sampling.local_size))

    def _stream_share(self, sampling: Sampling) -> Optional[tuple[int, int, int, int]]:
        return None


class StreamSource(DocumentSource):
    """`data.streaming=true`: each rank reads its own share of the records as they arrive."""

    def check_files(self, d: DataConfig, model: ModelFacts) -> None:
        super().check_files(d, model)
        require(d.val_path is not None, "data.val_path",
                "data.streaming=true reads validation from its own file: set data.val_path")

    def prepared_supervised_share(self, d: DataConfig,
                                  model: ModelFacts) -> Optional[tuple[float, str]]:
        return None  # a stream is tokenized as it arrives: nothing to read before the run

    def _stream_share(self, sampling: Sampling) -> Optional[tuple[int, int, int, int]]:
        # A sequence group reads one share of the records: its ranks slice the same windows.
        return (sampling.data_rank, sampling.data_size, sampling.micro_batch_size,
                sampling.grad_accum)

    def open(self, d: DataConfig, model: ModelFacts, sampling: Sampling,
             preprocess: Optional[dict], device: torch.device,
             watchdog: TimeoutWatchdog) -> Data:
        from trainer.data.batches import StreamedData

        stream, val = self.datasets(d, model, sampling)
        return StreamedData(stream, val, sampling, d.workers, device, watchdog)
