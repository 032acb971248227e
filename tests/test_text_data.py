"""data=text and data=chat: reading with `datasets`, chat templates and their masks, packing,
the cache, and the one-line errors (issue 25). The model side of packing (attention that never
crosses a document) is in tests/test_packing_models.py; whole runs in tests/test_text_runs.py."""

from __future__ import annotations

import json
import os

import numpy as np
import pytest

from tests.helpers import config
from trainer.data.demo import (chat_records, make_tokenizer, text_records, write_jsonl,
                             write_parquet)
from trainer.config import ConfigError
from trainer.data import tokenize_docs
from trainer.data.chat import IGNORE, chat_tokens
from trainer.data.documents import text_datasets
from trainer.data.packing import best_fit_bins, concat_windows
from trainer.data.sources import DocSettings
from trainer.data.tokens import step_counts, train_batch
from trainer.preflight.precheck import deep_check


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    from transformers import AutoTokenizer

    folder = make_tokenizer(tmp_path_factory.mktemp("tok") / "chatml")
    return str(folder), AutoTokenizer.from_pretrained(str(folder))


def windows(path, tok_folder, kind, cache, seq_len=64, **settings):
    return text_datasets(str(path), None, tok_folder, DocSettings(kind, seq_len, **settings),
                         str(cache), 10_000, preparer=True)


def test_jsonl_and_parquet_give_the_same_windows(tmp_path, tok) -> None:
    records = text_records(120)
    a = windows(write_jsonl(tmp_path / "d.jsonl", records), tok[0], "text", tmp_path / "c1")
    b = windows(write_parquet(tmp_path / "d.parquet", records), tok[0], "text", tmp_path / "c2")
    for split_a, split_b in zip(a, b):
        assert split_a.num_windows == split_b.num_windows > 0
        for name in ("inputs", "targets", "positions"):
            assert np.array_equal(getattr(split_a, name), getattr(split_b, name)), name


def test_chat_masks_keep_only_the_assistant_turns(tok) -> None:
    _, tokenizer = tok
    messages = [{"role": "system", "content": "the lazy dog"},
                {"role": "user", "content": "quick brown fox"},
                {"role": "assistant", "content": "seven wizards"},
                {"role": "user", "content": "jovial zebras"},
                {"role": "assistant", "content": "packing boxes of liquor jugs"}]
    ids, supervised = chat_tokens(tokenizer, messages, "assistant")
    learned = tokenizer.decode([i for i, s in zip(ids, supervised) if s])
    assert learned == "seven wizards<|im_end|>packing boxes of liquor jugs<|im_end|>"
    ignored = tokenizer.decode([i for i, s in zip(ids, supervised) if not s])
    for text in ("the lazy dog", "quick brown fox", "jovial zebras", "<|im_start|>assistant"):
        assert text in ignored
    ids_last, last = chat_tokens(tokenizer, messages, "last")
    assert tokenizer.decode([i for i, s in zip(ids_last, last) if s]) == (
        "packing boxes of liquor jugs<|im_end|>")
    assert all(chat_tokens(tokenizer, messages, "all")[1])


def test_packed_windows_keep_every_supervised_token(tmp_path, tok) -> None:
    """Conservation: what the documents supervise is what the windows supervise (text), and
    for chat what truncation cut is counted; windows never hold a label across documents."""
    _, tokenizer = tok
    train, val = windows(write_jsonl(tmp_path / "t.jsonl", text_records(200)), tok[0], "text",
                         tmp_path / "c")
    meta = json.load(open(os.path.join(os.path.dirname(train.folder), "meta.json")))
    # Each document of n tokens supervises n - 1 targets (its first token is never a target).
    assert train.counts[:, 0].sum() + val.counts[:, 0].sum() == meta["tokens"] - (
        meta["documents"] - meta["skipped"])
    chat_train, _ = windows(write_jsonl(tmp_path / "c.jsonl", chat_records(200)), tok[0],
                            "chat", tmp_path / "c", seq_len=96)
    chat_meta = json.load(open(os.path.join(os.path.dirname(chat_train.folder), "meta.json")))
    assert chat_meta["train"]["truncated"] > 0  # some conversations exceed 96 tokens
    eos = tokenizer.eos_token_id
    for split, allowed in ((train, {eos}), (chat_train, {eos, IGNORE})):
        for k in range(split.num_windows):
            targets, positions = split.targets[k], split.positions[k]
            steps = positions[1:] - positions[:-1]
            assert np.all(steps[positions[1:] != 0] == 1)  # positions count up within a document
            # Where the next position starts a document, the target is the end of this one,
            # never the next document's first token.
            ends = targets[:-1][positions[1:] == 0]
            assert set(ends.tolist()) <= allowed, (k, set(ends.tolist()))


def test_best_fit_fills_windows_and_never_cuts_a_document() -> None:
    rng = np.random.default_rng(0)
    lengths = rng.integers(5, 200, size=400).tolist()
    bins = best_fit_bins(lengths, 256)
    assert sorted(i for b in bins for i in b) == list(range(400))  # each once, whole
    assert all(sum(lengths[i] for i in b) <= 256 for b in bins)
    fill = sum(lengths) / (len(bins) * 256)
    assert fill > 0.95, fill


def test_concat_windows_restart_positions_and_cut_at_edges() -> None:
    docs = [(np.arange(10, 20), np.ones(10, bool)), (np.arange(30, 36), np.ones(6, bool))]
    out = list(concat_windows(docs, 8, pad_id=0))
    rows = np.concatenate([w for w, _ in out], axis=1)
    assert [real for _, real in out] == [8, 6]
    assert rows[2].tolist() == [0, 1, 2, 3, 4, 5, 6, 7, 0, 0, 1, 2, 3, 4, 0, 1]
    # The second document's first token (30) is never a target: no label crosses documents.
    assert 30 not in rows[1].tolist() and rows[1][:9].tolist() == list(range(11, 20))


def test_a_second_start_reuses_the_cache(tmp_path, tok, monkeypatch) -> None:
    path = write_jsonl(tmp_path / "t.jsonl", text_records(50))
    first = windows(path, tok[0], "text", tmp_path / "c")
    monkeypatch.setattr(tokenize_docs, "tokenize",
                        lambda *a, **k: pytest.fail("tokenized again"))
    again = windows(path, tok[0], "text", tmp_path / "c")
    assert again[0].folder == first[0].folder
    os.utime(path, ns=(1, 1))  # the file changed: a new key, tokenized again
    with pytest.raises(pytest.fail.Exception, match="tokenized again"):
        windows(path, tok[0], "text", tmp_path / "c")


def test_records_without_an_assistant_turn_are_counted_and_skipped(tmp_path, tok) -> None:
    records = chat_records(40)
    for r in records[:5]:
        r["messages"] = [m for m in r["messages"] if m["role"] != "assistant"]
    train, _ = windows(write_jsonl(tmp_path / "c.jsonl", records), tok[0], "chat", tmp_path / "c")
    meta = json.load(open(os.path.join(os.path.dirname(train.folder), "meta.json")))
    assert meta["skipped"] == 5 and meta["documents"] == 40


def test_the_global_order_does_not_depend_on_the_ranks(tmp_path, tok) -> None:
    train, _ = windows(write_jsonl(tmp_path / "t.jsonl", text_records(200)), tok[0], "text",
                       tmp_path / "c", seq_len=32)
    one = train_batch(train, 3, 4, 2, 0, 1, seed=5)  # 8 samples, one rank, accumulation 2
    two = [mb for r in range(2) for mb in train_batch(train, 3, 2, 2, r, 2, seed=5)]
    cat = [np.concatenate([b[i].numpy() for b in batches]) for batches in (one, two)
           for i in range(3)]
    assert all(np.array_equal(a, b) for a, b in zip(cat[:3], cat[3:]))
    supervised, real = step_counts(train, 3, 8, seed=5)
    assert supervised == sum(int((b[1] != IGNORE).sum()) for b in one) and real <= 8 * 32


@pytest.mark.parametrize("override, says", [
    ("data.path=/nope/missing.jsonl", "error-path"),
    ("data.text_field=body", "data.text_field: .* has no field 'body'; its fields: id, text"),
    ("data.tokenizer=/nope/tok", "data.tokenizer: cannot load a tokenizer"),
    ("model.vocab_size=100", "model.vocab_size: the tokenizer .* has 300 ids"),
])
def test_bad_text_settings_are_one_line_before_start(tmp_path, tok, override, says) -> None:
    path = write_jsonl(tmp_path / "t.jsonl", text_records(5))
    cfg = config("data=text", f"data.path={path}", f"data.tokenizer={tok[0]}", "data.seq_len=64",
                 f"data.cache_dir={tmp_path}", override)
    with pytest.raises(ConfigError, match="data.path: no such file" if says == "error-path"
                       else says):
        deep_check(cfg)


def test_bad_chat_input_is_one_line(tmp_path, tok) -> None:
    no_template = make_tokenizer(tmp_path / "plain", template=None)
    path = write_jsonl(tmp_path / "c.jsonl", chat_records(3))
    cfg = config("data=chat", f"data.path={path}", f"data.tokenizer={no_template}")
    with pytest.raises(ConfigError, match="data.tokenizer: .* has no chat template"):
        deep_check(cfg)
    bad = tmp_path / "latin1.jsonl"
    bad.write_bytes(b'{"text": "caf\xe9"}\n')
    with pytest.raises(ConfigError, match="data.path: .* is not UTF-8"):
        deep_check(config("data=text", f"data.path={bad}", f"data.tokenizer={tok[0]}"))
    broken = tmp_path / "x.parquet"
    broken.write_bytes(b"not parquet at all")
    with pytest.raises(ConfigError, match="data.path: .* is not a readable parquet file"):
        deep_check(config("data=text", f"data.path={broken}", f"data.tokenizer={tok[0]}"))
    wrong = write_jsonl(tmp_path / "w.jsonl", [{"conversation": []}])
    with pytest.raises(ConfigError, match="data.format: .* its fields: conversation"):
        deep_check(config("data=chat", f"data.path={wrong}", f"data.tokenizer={tok[0]}"))
