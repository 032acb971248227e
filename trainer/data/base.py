"""What every data source answers, and what it is told.

A `Source` (one per kind of data: token windows, documents prepared or streamed, images) is
chosen from `data.source` and `data.streaming` by trainer/data/factory.py, the one place those
are compared. It checks its own settings (without torch, so a bad command line is refused
fast), checks its files against the libraries before a run starts, and opens the `Data` the
Trainer holds: this rank's micro-batches of every step with the step's token counts, the
validation batches, and what a resume needs.

The data never asks which model reads it: it is told what it needs (`ModelFacts`), and how
this rank shares the global batch (`Sampling`, trainer/data/batches.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Optional

from trainer.config import DataConfig, require

if TYPE_CHECKING:
    import torch

    from trainer.data.batches import Data, Sampling
    from trainer.faults import TimeoutWatchdog


@dataclass(frozen=True)
class ModelFacts:
    """What the data needs to know of the model that reads it."""
    vocab_size: int  # the vocabulary the model embeds: token ids must stay below it
    vocab_key: str  # the setting that sets it
    tokenizer: Optional[str] = None  # the model's own tokenizer (model=hf with model.path)
    path: Optional[str] = None  # model.path, where documents' tokenizer is looked for last
    image_size: int = 0
    channels: int = 0
    num_classes: int = 0


class Source:
    """One kind of data. `name` is data.source; subclasses say what differs."""

    sums_loss = False  # the loss is a sum over supervised targets (packed documents)
    sample = "tokens"  # what one sample is: the model's family must read the same

    def __init__(self, name: str) -> None:
        self.name = name

    def check(self, d: DataConfig) -> None:
        """Settings that apply to another source only."""
        require(not d.augment, "data.augment",
                f"only applies to data=images (now data.source={self.name})")

    def check_reader(self, sample: str, arch: str) -> None:
        """The model (`arch`, named in the message) reads this kind of sample: `sample` is its
        family's ("tokens" or "images", trainer/models/families/base.py)."""
        require(sample == self.sample, "data.source",
                f"model.arch={arch} classifies images; use data=synthetic_images or data=images "
                f"(now data.source={self.name})")

    def run_tokenizer(self, d: DataConfig, own: Optional[str]) -> Optional[str]:
        """The tokenizer that made a run's ids, to read its model back (trainer.generate, the
        export folder): a folder or name, trainer/data/run_tokenizer.py's BYTES, or None when
        the run does not say. `own`: the model's own tokenizer (model=hf's model.path)."""
        return d.tokenizer

    def with_demo(self, d: DataConfig, own: Optional[str]) -> DataConfig:
        """`d` reading the demo set data.path=demo names, made on first use; here, `d` as it is
        (only documents have a demo set)."""
        return d

    def check_files(self, d: DataConfig, model: ModelFacts) -> None:
        """What the config's values and the files' names and sizes tell (no torch)."""

    def check_deep(self, d: DataConfig, model: ModelFacts) -> None:
        """What only the libraries and the files' contents tell (before the run starts)."""

    def prepared_supervised_share(self, d: DataConfig,
                                  model: ModelFacts) -> Optional[tuple[float, str]]:
        """(the largest share of a window's targets that are learned, where that was read) from
        data prepared before, or None: every target is learned, or nothing is prepared yet."""
        return None

    def datasets(self, d: DataConfig, model: ModelFacts, sampling: Sampling,
                 preprocess: Optional[dict] = None) -> tuple:
        """(train, validation) datasets, indexable by the global sampler."""
        raise NotImplementedError

    def open(self, d: DataConfig, model: ModelFacts, sampling: Sampling,
             preprocess: Optional[dict], device: torch.device,
             watchdog: TimeoutWatchdog) -> Data:
        """The Data the Trainer holds. preprocess: how a pretrained image model scales its
        inputs (its family says); device and watchdog: where a step's counts are summed."""
        from trainer.data.batches import SampledData

        train, val = self.datasets(d, model, sampling, preprocess)
        return SampledData(train, val, sampling, d.workers)
