"""The tokenized data a run trusts (issue 39, items 2 and 3): cached files checked before use,
the data's identity compared on resume, leftovers of dead writers removed, a full cache and bad
records each one line naming the file. Whole runs through the CLI are in
tests/test_data_resume.py."""

from __future__ import annotations

import fcntl
import json
import os
import subprocess
import sys
import time

import numpy as np
import pytest

from tests.helpers import REPO, config, small_tmpfs, subprocess_env
from trainer.config import ConfigError
from trainer.data import tokenize_docs
from trainer.data.cache_files import CacheFull, problem, remove_dead_temps
from trainer.data.demo import chat_records, make_tokenizer, text_records, write_jsonl, write_parquet
from trainer.data.documents import skipped_line, text_datasets
from trainer.data.identity import change, continue_order
from trainer.data.sources import DataError, DocSettings
from trainer.preflight.precheck import deep_check


@pytest.fixture(scope="module")
def tok(tmp_path_factory) -> str:
    return str(make_tokenizer(tmp_path_factory.mktemp("tok") / "chatml"))


def windows(path, tok, kind, cache, seq_len=64, val_path=None, **settings):
    return text_datasets(str(path), val_path and str(val_path), tok,
                         DocSettings(kind, seq_len, **settings), str(cache), 10_000, True)


def meta_of(train) -> dict:
    with open(os.path.join(os.path.dirname(train.folder), "meta.json")) as f:
        return json.load(f)


def test_a_cache_file_changed_in_range_or_truncated_is_caught_and_rebuilt(tmp_path, tok,
                                                                          monkeypatch) -> None:
    path = write_jsonl(tmp_path / "t.jsonl", text_records(60))
    train, _ = windows(path, tok, "text", tmp_path / "c")
    folder = os.path.dirname(train.folder)
    good = np.array(train.inputs)
    inputs = os.path.join(train.folder, "inputs.npy")
    flipped = np.load(inputs, mmap_mode="r+")
    flipped[0, 0] = (int(flipped[0, 0]) + 1) % 200  # same size, still a valid id
    flipped.flush()
    del flipped, train
    assert problem(folder, meta_of_folder(folder), 10_000) == (
        f"{inputs}: its checksum differs from the one written with it (the file changed)")
    again, _ = windows(path, tok, "text", tmp_path / "c")  # rebuilt, not trusted
    assert np.array_equal(np.array(again.inputs), good)
    with open(inputs, "r+b") as f:
        f.truncate(os.path.getsize(inputs) - 100)
    wrong = problem(folder, meta_of_folder(folder), 10_000)
    assert wrong.startswith(f"{inputs}: ") and "truncated" in wrong
    calls = []
    real = tokenize_docs.tokenize
    monkeypatch.setattr(tokenize_docs, "tokenize", lambda *a, **k: calls.append(1) or real(*a, **k))
    rebuilt, _ = windows(path, tok, "text", tmp_path / "c")
    assert calls and np.array_equal(np.array(rebuilt.inputs), good)
    assert problem(folder, meta_of_folder(folder), 100) == (
        f"{folder}: holds token id {int(good.max())}, not below the model's vocabulary of 100")


def test_meta_json_counts_that_are_not_the_files_are_caught_and_rebuilt(tmp_path, tok) -> None:
    """False window counts with intact checksums were trusted, and went into the checkpoint's
    data identity."""
    path = write_jsonl(tmp_path / "c.jsonl", chat_records(60))
    train, _ = windows(path, tok, "chat", tmp_path / "c")
    folder, good = os.path.dirname(train.folder), train.num_windows
    meta = meta_of_folder(folder)
    meta["train"]["windows"] += 5
    with open(os.path.join(folder, "meta.json"), "w") as f:
        json.dump(meta, f)
    assert problem(folder, meta, 10_000) == (
        f"{folder}/meta.json: says {good + 5} train windows, its files hold {good}")
    again, _ = windows(path, tok, "chat", tmp_path / "c")  # prepared again, not trusted
    assert again.num_windows == good and meta_of_folder(folder)["train"]["windows"] == good


def meta_of_folder(folder: str) -> dict:
    with open(os.path.join(folder, "meta.json")) as f:
        return json.load(f)


def test_temporary_folders_of_dead_writers_are_removed(tmp_path) -> None:
    dead = tmp_path / "abc.tmp-999999999"  # no such pid, and nobody holds abc.lock
    dead.mkdir()
    (dead / "train").mkdir()
    live = tmp_path / "xyz.tmp-1"
    live.mkdir()
    with open(tmp_path / "xyz.lock", "w") as held:
        fcntl.flock(held, fcntl.LOCK_EX)  # a writer at work (here: this test)
        child = subprocess.run([sys.executable, "-c", "import sys; from trainer.data.cache_files"
                                " import remove_dead_temps as r; print(r(sys.argv[1]))",
                                str(tmp_path)], capture_output=True, text=True,
                               env=subprocess_env(), cwd=REPO)
    assert child.returncode == 0, child.stderr
    assert not dead.exists() and live.exists()
    assert remove_dead_temps(str(tmp_path)) == [str(live)]  # its writer let go


def test_a_full_cache_dir_is_one_error_and_leaves_nothing(tmp_path, tok) -> None:
    with small_tmpfs(tmp_path / "small", "1m") as mount:
        path = write_jsonl(tmp_path / "t.jsonl", text_records(400))
        with pytest.raises(CacheFull, match=f"no space left in {mount} while caching"):
            windows(path, tok, "text", mount, seq_len=512, packing=False)  # 400 x 6 KiB
        assert [p.name for p in mount.iterdir() if p.is_dir()] == []


def test_a_malformed_jsonl_line_is_named_or_skipped_and_counted(tmp_path, tok) -> None:
    lines = [json.dumps(r) for r in chat_records(30)]
    lines[11] = lines[11][:-5]  # cut mid-record
    lines[20] = "[1, 2]"  # JSON, not a record
    path = tmp_path / "c.jsonl"
    path.write_text("\n".join(lines) + "\n")
    with pytest.raises(DataError, match=rf"^data.path: {path} line 12 is not JSON .*"
                       "data.skip_bad_records=true"):
        windows(path, tok, "chat", tmp_path / "c")
    train, _ = windows(path, tok, "chat", tmp_path / "c", skip_bad_records=True)
    meta = meta_of(train)
    assert meta["bad_records"] == 2 and meta["documents"] == 28
    assert meta["bad_record_examples"][1] == f"{path} line 21: a JSON list, not an object"
    assert "bad_records 2" in skipped_line(meta)


def test_one_corrupt_parquet_among_good_ones_is_named(tmp_path, tok) -> None:
    folder = tmp_path / "pq"
    folder.mkdir()
    for k in range(3):
        write_parquet(folder / f"part-{k}.parquet", text_records(10, seed=k))
    (folder / "part-1.parquet").write_bytes(b"PAR1 not really")
    with pytest.raises(ConfigError, match=f"data.path: {folder}/part-1.parquet is not a readable"):
        deep_check(config("data=text", f"data.path={folder}", f"data.tokenizer={tok}"))


def test_a_chat_template_that_raises_names_the_record(tmp_path) -> None:
    raising = make_tokenizer(tmp_path / "strict", template=(
        "{% for m in messages %}{% if m['content'] == 'boom' %}"
        "{{ raise_exception('roles must alternate user/assistant') }}{% endif %}"
        "<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"))
    records = chat_records(12)
    records[7]["messages"][0]["content"] = "boom"
    path = write_jsonl(tmp_path / "c.jsonl", records)
    with pytest.raises(DataError) as caught:
        windows(path, str(raising), "chat", tmp_path / "c")
    line = str(caught.value)
    assert "\n" not in line and line.startswith(f"data.tokenizer: its chat template fails on "
                                                f"{path} record 7")
    assert "roles must alternate user/assistant" in line
    train, _ = windows(path, str(raising), "chat", tmp_path / "c", skip_bad_records=True)
    meta = meta_of(train)
    assert meta["bad_records"] == 1 and meta["skipped_why"]["bad_records"] == 1


def test_overlong_drop_emptying_a_split_is_one_line_and_counts_agree(tmp_path, tok) -> None:
    records = chat_records(40)
    path = write_jsonl(tmp_path / "c.jsonl", records)
    with pytest.raises(DataError, match=r"^data.overlong: all \d+ train documents of data.path "
                       r"are longer than data.seq_len=4 .* data.overlong=truncate"):
        windows(path, tok, "chat", tmp_path / "c", seq_len=4, overlong="drop")
    train, _ = windows(path, tok, "chat", tmp_path / "c", seq_len=160, overlong="drop",
                       val_fraction=0.3)
    meta = meta_of(train)
    dropped = meta["train"]["dropped_overlong"], meta["val"]["dropped_overlong"]
    assert sum(dropped) > 0
    assert f"dropped_overlong {dropped[0]} train, {dropped[1]} val" in skipped_line(meta)
    assert skipped_line(meta).startswith(f"skipped {meta['skipped']} documents")


def test_no_assistant_turn_anywhere_names_the_cause_and_the_file(tmp_path, tok) -> None:
    records = chat_records(10)
    for r in records:
        r["messages"] = [m for m in r["messages"] if m["role"] != "assistant"]
    path = write_jsonl(tmp_path / "c.jsonl", records)
    with pytest.raises(DataError, match=f"^data.path: none of the 10 records in {path} has an "
                       "assistant turn to learn"):
        windows(path, tok, "chat", tmp_path / "c")


def test_a_missing_val_path_is_named_as_such(tmp_path, tok) -> None:
    path = write_jsonl(tmp_path / "t.jsonl", text_records(5))
    with pytest.raises(ConfigError, match=f"^data.val_path: no such file: {tmp_path}/nope.jsonl"):
        deep_check(config("data=text", f"data.path={path}", f"data.tokenizer={tok}",
                          f"data.val_path={tmp_path}/nope.jsonl"))


def test_an_hf_vocabulary_smaller_than_the_tokenizer_names_hf_config(tmp_path, tok) -> None:
    path = write_jsonl(tmp_path / "t.jsonl", text_records(5))
    hf = ("model.hf_config={model_type: llama, vocab_size: 100, hidden_size: 32, "
          "intermediate_size: 64, num_hidden_layers: 2, num_attention_heads: 2, "
          "num_key_value_heads: 2}")
    with pytest.raises(ConfigError, match="^model.hf_config.vocab_size: the tokenizer .* has 300 "
                       "ids, more than the model's 100"):
        deep_check(config("model=hf", hf, "data=text", f"data.path={path}",
                          f"data.tokenizer={tok}"))


def test_a_dataset_or_tokenizer_name_without_network_fails_fast(tmp_path) -> None:
    """HF_ENDPOINT at a local port nobody listens on: one line each within seconds, no
    retries."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # closed again: connections are refused
    code = ("from trainer.data.sources import open_documents, load_tokenizer, DataError\n"
            "try:\n open_documents('someone/no-such-dataset', 'train')\n"
            "except DataError as e:\n print(e)\n"
            "try:\n load_tokenizer('someone/no-such-tokenizer', 'text')\n"
            "except DataError as e:\n print(e)\n")
    started = time.monotonic()
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO,
                          env=subprocess_env({"HF_ENDPOINT": f"http://127.0.0.1:{port}",
                                              "HF_HOME": str(tmp_path / "hf")}), timeout=120)
    took = time.monotonic() - started
    assert done.returncode == 0, done.stderr[-2000:]
    dataset, tokenizer = done.stdout.splitlines()
    assert dataset.startswith(f"data.path: 'someone/no-such-dataset' is no file or folder "
                              f"here, and the hub (http://127.0.0.1:{port}) is out of reach")
    assert tokenizer.startswith(f"data.tokenizer: cannot load a tokenizer from "
                                f"someone/no-such-tokenizer (the hub (http://127.0.0.1:{port}) "
                                "is out of reach, and it is not in the local cache")
    assert took < 20, took  # imports included; 56 s with the hub's retries (2026-12-03)


def test_the_data_identity_says_what_changed_and_new_epoch_restarts_the_order(tmp_path,
                                                                              tok) -> None:
    path = tmp_path / "c.jsonl"
    write_jsonl(path, chat_records(60))
    before = windows(path, tok, "chat", tmp_path / "c")[0].identity
    os.utime(path, ns=(5, 5))  # touched, same bytes: the same windows
    touched = windows(path, tok, "chat", tmp_path / "c")[0].identity
    assert touched["key"] != before["key"] and change(before, touched) is None
    write_jsonl(path, chat_records(90))
    after = windows(path, tok, "chat", tmp_path / "c")[0].identity
    what = change(before, after)
    assert what == (f"data.path grew: {before['windows']['train']} -> "
                    f"{after['windows']['train']} training windows (c.jsonl: "
                    f"{before['files']['data.path'][0][1]:,} -> {os.path.getsize(path):,} bytes)")
    saved = {"identity": before, "origin": 0}
    assert continue_order(saved, before, "refuse", 12, 3) == (0, None)
    with pytest.raises(ConfigError, match=r"^data.on_change: the data differs from what the "
                       r"checkpoint of step 3 was trained on: data.path grew: .* set "
                       r"data.on_change=new_epoch"):
        continue_order(saved, after, "refuse", 12, 3)
    origin, note = continue_order(saved, after, "new_epoch", 12, 3)
    assert origin == 12 and note.startswith("data changed since the checkpoint of step 3")


def test_a_damaged_cache_that_cannot_be_prepared_again_is_refused_naming_the_file(
        tmp_path, tok, monkeypatch) -> None:
    """A dataset name's cache is found without the hub; with the hub out of reach it cannot be
    tokenized again, and the line names the damaged file as well as why."""
    from trainer.data import documents

    path = write_jsonl(tmp_path / "t.jsonl", text_records(40))
    train, _ = windows(path, tok, "text", tmp_path / "c")
    targets = os.path.join(train.folder, "targets.npy")
    with open(targets, "r+b") as f:
        f.truncate(200)

    def offline(*args, **kwargs):
        raise DataError("data.path: 'x/y' is no file or folder here, and the hub is out of reach")

    monkeypatch.setattr(documents, "prepare", offline)
    with pytest.raises(DataError, match=rf"^data.cache_dir: {targets}: 200 bytes, written as "
                       r"\d+ \(truncated or overwritten\), and preparing it again failed: "
                       "data.path: 'x/y'"):
        windows(path, tok, "text", tmp_path / "c")
