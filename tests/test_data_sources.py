"""One source object per kind of data (trainer/data/factory.py), and the Data the Trainer holds
(trainer/data/batches.py): a step's micro-batches and counts, validation, what a resume needs."""

from __future__ import annotations

import pytest
import torch

from trainer.config import ConfigError, DataConfig
from trainer.data.base import ModelFacts
from tests.helpers import sampling
from trainer.data.batches import SampledData, StreamedData
from trainer.data.document_source import DocumentSource, StreamSource
from trainer.data.factory import source_of
from trainer.data.image_source import ImageSource
from trainer.data.token_source import TokenSource
from trainer.data.tokens import step_counts, train_batch
from trainer.data.validation import val_batches
from trainer.faults import CollectiveFailure, TimeoutWatchdog


@pytest.mark.parametrize("source, streaming, kind", [
    ("bytes", False, TokenSource), ("tokens", False, TokenSource),
    ("synthetic", False, TokenSource), ("text", False, DocumentSource),
    ("chat", False, DocumentSource), ("text", True, StreamSource), ("chat", True, StreamSource),
    ("images", False, ImageSource), ("synthetic_images", False, ImageSource)])
def test_the_factory_gives_each_source_its_object(source, streaming, kind) -> None:
    found = source_of(DataConfig(source=source, streaming=streaming))
    assert type(found) is kind and found.name == source
    assert found.sums_loss == (kind in (DocumentSource, StreamSource))


def test_only_documents_stream() -> None:
    """A stream of token windows or images used to fail at the first batch; now one line."""
    with pytest.raises(ConfigError, match=r"^data.streaming: only applies to data=text or chat "
                                          r"\(now data.source=bytes\)"):
        source_of(DataConfig(source="bytes", streaming=True))


def test_the_sources_check_their_own_settings() -> None:
    images, tokens = ImageSource("images"), TokenSource("tokens")
    images.check(DataConfig(source="images", augment=True))
    with pytest.raises(ConfigError, match="^data.augment: only applies to data=images"):
        tokens.check(DataConfig(source="tokens", augment=True))
    images.check_reader("images", "vit")
    with pytest.raises(ConfigError, match="^data.source: images are images, which "
                                          "model.arch=llama does not read"):
        images.check_reader("tokens", "llama")
    with pytest.raises(ConfigError, match="^data.source: model.arch=vit classifies images"):
        tokens.check_reader("images", "vit")
    model = ModelFacts(200, "model.vocab_size")
    with pytest.raises(ConfigError, match="^model.vocab_size: data.source=bytes needs a "
                                          "vocabulary of at least 256, got 200"):
        TokenSource("bytes").check_files(DataConfig(), model)


SAMPLING = sampling(rank=1, world_size=2, micro_batch_size=2, grad_accum=3, seed=7,
                    eval_batches=2)


@pytest.mark.parametrize("workers", [0, 2])
def test_sampled_data_is_the_global_sampler(workers: int) -> None:
    train, val = TokenSource("synthetic").datasets(DataConfig(source="synthetic", seq_len=8),
                                                   ModelFacts(50, "model.vocab_size"), SAMPLING)
    data = SampledData(train, val, SAMPLING, workers)
    try:
        for index in (0, 1, 5, 2):
            batches, counts = data.batch(index)
            expected = train_batch(train, index, 2, 3, 1, 2, 7)
            assert counts is None and counts == step_counts(train, index, 12, 7)
            assert len(batches) == 3 and all(torch.equal(a, b) for got, want in
                                              zip(batches, expected) for a, b in zip(got, want))
        want_val = val_batches(val, 2, 2, 1, 2)
        assert all(torch.equal(a, b) for got, want in zip(data.val, want_val)
                   for a, b in zip(got, want))
        data.check_resume(8, 64)  # the global order does not depend on the world: any resumes
    finally:
        data.close()


class _Stream:
    """A stream's read(step): one micro-batch and this rank's (supervised, real) counts."""

    def read(self, step: int):
        return [(torch.full((1, 4), step),)], (step, 10 * step)


def test_a_stream_resumes_only_on_its_own_share() -> None:
    val = TokenSource("synthetic").datasets(DataConfig(source="synthetic", seq_len=8),
                                            ModelFacts(50, "model.vocab_size"), SAMPLING)[1]
    data = StreamedData(_Stream(), val, SAMPLING, 0, torch.device("cpu"),
                        TimeoutWatchdog(1, 5))
    try:
        batches, counts = data.batch(3)  # one process: its own counts are the step's
        assert counts == (3, 30) and torch.equal(batches[0][0], torch.full((1, 4), 3))
        data.check_resume(2, 12)
        with pytest.raises(ConfigError, match=r"^data.streaming: this run streams its data and "
                                              r"was saved by 4 ranks with a global batch of 12"):
            data.check_resume(4, 12)
    finally:
        data.close()


def test_the_watchdog_names_a_stuck_collective_and_passes_the_rest() -> None:
    watchdog = TimeoutWatchdog(rank=3, timeout_s=5)
    with pytest.raises(CollectiveFailure, match=r"^rank 3: saving step 8 failed waiting for "
                                                r"the other ranks \(timeout "
                                                r"train.dist_timeout_s=5\): socket timed out"):
        with watchdog("saving step 8"):
            raise RuntimeError("socket timed out")
    with pytest.raises(KeyError):
        with watchdog("saving step 8"):
            raise KeyError("not a collective")
