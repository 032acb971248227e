"""Chat preparation a batch at a time (trainer/data/chat_batch.py): the same tokens and masks
as the per-conversation way, bit for bit, on the templates whose turns end with eos; the same
cache whatever data.num_proc; data.num_proc checked; bad text records named and skippable."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from trainer.data.chat import chat_tokens
from trainer.data.chat_batch import chat_batch
from trainer.data.demo import (chat_records, make_shaped_tokenizer, make_tokenizer,
                               text_records, write_jsonl, write_parquet)

# ChatML, Llama-3 (byte-level BPE), and the SentencePiece-style [INST] templates (Llama-2,
# Mistral: their pieces merge across a turn's boundary).
SHAPES = ("chatml", "llama3", "llama2", "mistral")


@pytest.fixture(scope="module")
def tokenizers(tmp_path_factory):
    from transformers import AutoTokenizer

    root = tmp_path_factory.mktemp("batch_shapes")
    return {shape: AutoTokenizer.from_pretrained(str(make_shaped_tokenizer(root / shape, shape)))
            for shape in SHAPES}


def _conversations(shape: str) -> list[list[dict]]:
    talks = [r["messages"] for r in chat_records(120, seed=11)]
    if shape == "mistral":  # its template has no place for a system prompt
        talks = [t[1:] for t in talks]
    # Edges: a reply the user quoted, an empty reply, spaces around a reply, no reply at all.
    first = talks[0][-2:]
    talks += [first[:1] + [{"role": "user", "content": first[1]["content"]},
                           {"role": "assistant", "content": first[1]["content"]}],
              [{"role": "user", "content": "the dog"}, {"role": "assistant", "content": ""}],
              [{"role": "user", "content": "a fox"}, {"role": "assistant", "content": " jumps "}],
              [{"role": "user", "content": "only a question"}]]
    return talks


@pytest.mark.parametrize("train_on", ["assistant", "last", "all"])
@pytest.mark.parametrize("shape", SHAPES)
def test_masks_are_the_per_conversation_ways_bit_for_bit(tokenizers, shape, train_on) -> None:
    tokenizer, talks = tokenizers[shape], _conversations(shape)
    names = [f"record {i}" for i in range(len(talks))]
    batched = chat_batch(tokenizer, talks, train_on, names)
    for messages, name, got in zip(talks, names, batched):
        assert not isinstance(got, Exception), (name, got)
        assert got == chat_tokens(tokenizer, messages, train_on, name), (shape, name)
    assert sum(sum(sup) for _, sup in batched) > 0


def test_a_reply_not_in_the_rendered_text_goes_the_per_conversation_way(tmp_path) -> None:
    """A template that changes a reply (upper case): refused by name, as before."""
    from transformers import AutoTokenizer

    template = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] | upper }}"
                "<|im_end|>\n{% endfor %}")
    tokenizer = AutoTokenizer.from_pretrained(str(make_tokenizer(tmp_path / "t",
                                                                 template=template)))
    talk = [{"role": "user", "content": "the fox"}, {"role": "assistant", "content": "a dog"}]
    got = chat_batch(tokenizer, [talk], "assistant", ["c.jsonl record 3"])[0]
    assert isinstance(got, ValueError) and "c.jsonl record 3" in str(got)


def _prepare(tmp_path: Path, name: str, path: Path, tokenizer: str, kind: str, num_proc: int,
             **settings) -> Path:
    from trainer.data.documents import text_datasets
    from trainer.data.sources import DocSettings

    train, _ = text_datasets(str(path), None, tokenizer, DocSettings(kind, 128, **settings),
                             str(tmp_path / name), 10_000, preparer=True, num_proc=num_proc)
    return Path(train.folder).parent


@pytest.mark.parametrize("kind", ["chat", "text"])
def test_the_cache_is_the_same_bytes_whatever_num_proc(tmp_path, kind) -> None:
    tokenizer = str(make_tokenizer(tmp_path / "tok"))
    records = chat_records(700, seed=2) if kind == "chat" else text_records(700, seed=2)
    path = write_jsonl(tmp_path / "d.jsonl", records)
    one = _prepare(tmp_path, "one", path, tokenizer, kind, 1)
    two = _prepare(tmp_path, "two", path, tokenizer, kind, 2)
    files = sorted(p.relative_to(one) for p in one.rglob("*") if p.is_file())
    assert files == sorted(p.relative_to(two) for p in two.rglob("*") if p.is_file())
    for name in files:
        if name.name != "meta.json":
            assert (one / name).read_bytes() == (two / name).read_bytes(), name
    timed = ("tokenize_s", "seconds")  # how long it took is all that may differ
    meta = [{k: v for k, v in json.loads((d / "meta.json").read_text()).items()
             if k not in timed} for d in (one, two)]
    assert meta[0] == meta[1] and meta[0]["documents"] == 700


def test_preparing_again_leaves_no_copy_of_the_data_behind(tmp_path, monkeypatch) -> None:
    """Each preparation's map wrote the tokenized documents (and filter's and select's indices)
    into `datasets`' own cache, beside its copy of the records, and never removed them: the
    disk filled a copy of the data per preparation. Only the records' copy may stay there
    (`datasets` reads it again for the same files)."""
    import datasets

    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", tmp_path / "hf")
    tokenizer = str(make_tokenizer(tmp_path / "tok"))
    path = write_jsonl(tmp_path / "d.jsonl", chat_records(300, seed=4))
    hf = []
    for name, num_proc in (("one", 1), ("two", 2), ("three", 1)):
        _prepare(tmp_path, name, path, tokenizer, "chat", num_proc)
        hf.append(sorted(p for p in (tmp_path / "hf").rglob("*") if p.is_file()))
        assert not list((tmp_path / name).rglob("*.arrow")), name
    assert hf[0] == hf[1] == hf[2], [p for p in hf[-1] if p not in hf[0]]


def test_preparing_in_two_processes_leaves_the_fast_tokenizer_its_threads(tmp_path,
                                                                       monkeypatch) -> None:
    """`datasets`' map(num_proc=2) set TOKENIZERS_PARALLELISM=false in the process's own
    environment and put back only a copy of `os.environ`: every later batch call of a fast
    tokenizer in the process then ran in one thread (the benchmark's num_proc 1 runs after its
    first num_proc 2 one included). A child process inherits the process's environment."""
    import os
    import subprocess
    import sys

    read = [sys.executable, "-c", "import os; print(os.environ.get('TOKENIZERS_PARALLELISM'))"]
    tokenizer = str(make_tokenizer(tmp_path / "tok"))
    path = write_jsonl(tmp_path / "d.jsonl", chat_records(300, seed=4))
    for name, was in (("unset", None), ("set", "true")):
        if was is None:
            monkeypatch.delenv("TOKENIZERS_PARALLELISM", raising=False)
        else:
            monkeypatch.setenv("TOKENIZERS_PARALLELISM", was)
        _prepare(tmp_path, name, path, tokenizer, "chat", 2)
        assert os.environ.get("TOKENIZERS_PARALLELISM") == was
        seen = subprocess.run(read, capture_output=True, text=True, check=True).stdout.strip()
        assert seen == str(was), name


@pytest.mark.parametrize("case", ["jsonl null", "jsonl number", "parquet null",
                                  "parquet numbers"])
def test_text_that_is_null_or_a_number_is_named_and_skippable(tmp_path, case) -> None:
    from trainer.data.sources import DataError

    tokenizer = str(make_tokenizer(tmp_path / "tok"))
    kind, bad = case.split()
    records = text_records(40, seed=1)
    records[5]["text"] = None if bad == "null" else 7
    if bad == "numbers":  # a parquet column holds one type: all numbers
        records = [{**r, "text": i} for i, r in enumerate(records)]
    path = (write_jsonl if kind == "jsonl" else write_parquet)(tmp_path / f"d.{kind}", records)
    with pytest.raises(DataError) as refused:
        _prepare(tmp_path, "cache", path, tokenizer, "text", 1)
    named = 0 if bad == "numbers" else 5
    what = "null" if bad == "null" else f"int {named if bad == 'numbers' else 7}"
    assert str(refused.value).startswith(
        f"data.text_field: 'text' of {path} record {named} (id {named}) is {what}, not text; "
        "fix the record, or set data.skip_bad_records=true"), str(refused.value)
    if bad == "numbers":
        return  # skipping them all leaves nothing to train on
    folder = _prepare(tmp_path, "skipped", path, tokenizer, "text", 2, skip_bad_records=True)
    meta = json.loads((folder / "meta.json").read_text())
    assert meta["bad_records"] == 1 and meta["documents"] == 40
    assert meta["bad_record_examples"][0].startswith(f"{path} record 5 (id 5): ")


def test_num_proc_that_is_no_count_is_one_line_exit_2(tmp_path) -> None:
    from tests.helpers import QUICK, run_trainer

    tokenizer = make_tokenizer(tmp_path / "tok")
    path = write_jsonl(tmp_path / "c.jsonl", chat_records(20))
    for value in ("0", "two"):
        done = run_trainer([*QUICK, "data=chat", f"data.path={path}",
                            f"data.tokenizer={tokenizer}", f"data.num_proc={value}",
                            f"hydra.run.dir={tmp_path / 'run'}"], tmp_path)
        lines = done.stderr.strip().splitlines()
        assert done.returncode == 2 and "Traceback" not in done.stderr, done.stderr[-2000:]
        assert lines[-1].startswith("error: data.num_proc"), lines[-1]
    assert not np.any([p.name == "run" for p in tmp_path.iterdir()])
