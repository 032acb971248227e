"""The one place `data.source` and `data.streaming` are compared: they choose the Source object,
and everything else asks that object (tests/test_architecture.py holds this line)."""

from __future__ import annotations

from dataclasses import fields, replace
from typing import TYPE_CHECKING, Mapping, Optional

from trainer.config import ConfigError, DataConfig
from trainer.data.base import ModelFacts, Source
from trainer.data.document_source import DocumentSource, StreamSource
from trainer.data.image_source import ImageSource
from trainer.data.token_source import TokenSource

if TYPE_CHECKING:
    import torch

    from trainer.data.batches import Data, Sampling
    from trainer.faults import TimeoutWatchdog

KINDS = {"bytes": TokenSource, "tokens": TokenSource, "synthetic": TokenSource,
         "text": DocumentSource, "chat": DocumentSource,
         "images": ImageSource, "synthetic_images": ImageSource}


def source_of(d: DataConfig) -> Source:
    """The Source of data.source (and data.streaming, for documents)."""
    kind = KINDS.get(d.source)
    if kind is None:
        raise ConfigError("data.source", f"got {d.source!r}; choose one of {', '.join(KINDS)}")
    if d.streaming:
        if kind is not DocumentSource:
            raise ConfigError("data.streaming", f"only applies to data=text or chat (now "
                              f"data.source={d.source}); set data.streaming=false")
        kind = StreamSource
    return kind(d.source)


def open_data(d: DataConfig, model: ModelFacts, sampling: Sampling,
              preprocess: Optional[dict], device: torch.device,
              watchdog: TimeoutWatchdog) -> Data:
    """The Data a Trainer holds (see Source.open)."""
    return source_of(d).open(d, model, sampling, preprocess, device, watchdog)


def tokenizer_of_run(data: Mapping, own: Optional[str]) -> Optional[str]:
    """A tokenizer folder or name, BYTES, or None when the run does not say (data=tokens and
    synthetic read ids made elsewhere). `data` is a checkpoint's data section, as saved."""
    known = {f.name for f in fields(DataConfig)}
    d = DataConfig(**{k: v for k, v in data.items() if k in known})
    return source_of(replace(d, streaming=False)).run_tokenizer(d, own)
