"""Packing reads tokenized documents through their Arrow columns (trainer/data/doc_columns.py):
the same documents as `datasets`' own row access, in the bins' order, across the takes; and
tokenizing puts Python's cycle collector back as it found it, with `usable` found per record."""

from __future__ import annotations

import gc

import numpy as np
import pytest

from trainer.data import doc_columns
from trainer.data.doc_columns import docs_in_bins, iter_docs


@pytest.fixture()
def docs():
    import datasets

    rng = np.random.default_rng(3)
    lengths = [0, 1, 5, 2, 9, 3, 0, 7, 4, 6, 8, 1]
    ids = [rng.integers(0, 50_000, n).tolist() for n in lengths]
    sup = [(rng.random(n) < 0.5).tolist() for n in lengths]
    full = datasets.Dataset.from_dict({"ids": ids, "sup": sup, "length": lengths})
    return full.select([11, 2, 4, 9, 0, 7, 5, 3, 10, 1, 8])  # an indices mapping, as after select


def _rows(docs, indices):
    return [(np.asarray(docs[int(i)]["ids"], dtype=np.int64), np.asarray(docs[int(i)]["sup"],
                                                                         dtype=bool))
            for i in indices]


def _same(got, want) -> None:
    assert len(got) == len(want)
    for (ids, sup), (ids_w, sup_w) in zip(got, want):
        assert ids.dtype == np.int64 and sup.dtype == bool
        np.testing.assert_array_equal(ids, ids_w)
        np.testing.assert_array_equal(sup, sup_w)


@pytest.mark.parametrize("at_once", [1, 2, 256])
def test_bins_read_the_documents_datasets_reads_in_their_order(docs, monkeypatch,
                                                                at_once) -> None:
    monkeypatch.setattr(doc_columns, "BINS_AT_ONCE", at_once)
    bins = [[3, 0], [10], [], [7, 1, 5], [2], [9, 8, 6], [4]]
    got = list(docs_in_bins(docs, bins))
    assert len(got) == len(bins)
    for parts, b in zip(got, bins):
        _same(parts, _rows(docs, b))


@pytest.mark.parametrize("batch", [1, 4, 1000])
def test_every_document_in_order(docs, batch) -> None:
    _same(list(iter_docs(docs, batch)), _rows(docs, range(len(docs))))


@pytest.mark.parametrize("enabled", [True, False])
def test_tokenizing_pauses_the_collector_and_leaves_it_as_it_found_it(tmp_path, monkeypatch,
                                                                     enabled) -> None:
    import datasets
    from transformers import AutoTokenizer

    from trainer.data import tokenize_docs
    from trainer.data.demo import chat_records, make_tokenizer
    from trainer.data.sources import DocSettings

    seen = []  # the collector's state while each batch is encoded
    encode = tokenize_docs.chat_batch
    monkeypatch.setattr(tokenize_docs, "chat_batch",
                        lambda *args: seen.append(gc.isenabled()) or encode(*args))
    tokenizer = AutoTokenizer.from_pretrained(str(make_tokenizer(tmp_path / "tok")))
    talks = [r["messages"] for r in chat_records(20, seed=5)]
    talks[4] = talks[4][:1]  # no assistant turn: nothing to learn
    records = datasets.Dataset.from_dict({"messages": talks})
    was = gc.isenabled()
    (gc.enable if enabled else gc.disable)()
    try:
        docs = tokenize_docs.tokenize(records, tokenizer, DocSettings("chat", 512), None,
                                      "test", arrow=str(tmp_path / "docs.arrow"))
        assert gc.isenabled() is enabled
    finally:
        (gc.enable if was else gc.disable)()
    assert seen == [False]
    assert docs["usable"] == [n != 4 for n in range(20)]
    assert all(length >= 2 for length in docs["length"])


def test_whole_columns_are_the_rows_values_after_a_select(docs) -> None:
    from trainer.data.doc_columns import column, listed

    lengths = column(docs, "length")
    assert lengths.tolist() == [docs[i]["length"] for i in range(len(docs))]
    assert lengths.tolist() == [1, 5, 9, 6, 0, 7, 3, 2, 8, 1, 4]
    assert listed(docs, "ids") == [docs[i]["ids"] for i in range(len(docs))]
