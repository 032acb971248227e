"""Token sources, windows, the step-indexed sampler and the tokenize command."""

from __future__ import annotations

import json
import os
import sysconfig
import zlib
from collections import Counter

import numpy as np
import pytest
import torch

from trainer.data import tokenize, tokens as data, validation


def window_ids(dataset: data.WindowDataset, inputs: torch.Tensor) -> list[int]:
    """Recover window indices from a batch built over arange tokens (token = position)."""
    return [int(row[0]) // dataset.seq_len for row in inputs]


def arange_dataset(num_windows: int, seq_len: int) -> data.WindowDataset:
    return data.WindowDataset(np.arange(num_windows * seq_len + 1, dtype=np.int64), seq_len)


def step_windows(dataset, step, mbs, accum, dp, seed) -> list[list[int]]:
    """Window ids per rank at one step, micro-batches concatenated in order."""
    per_rank = []
    for rank in range(dp):
        ids = []
        for inputs, targets in data.train_batch(dataset, step, mbs, accum, rank, dp, seed):
            assert inputs.shape == (mbs, dataset.seq_len) and inputs.dtype == torch.long
            assert torch.equal(targets, inputs + 1)  # arange tokens: target is next token
            ids += window_ids(dataset, inputs)
        per_rank.append(ids)
    return per_rank


# ---------------------------------------------------------------- stdlib corpus


def test_stdlib_corpus_deterministic_and_split_by_file():
    train_a, val_a = data.stdlib_corpus(max_bytes=300_000)
    train_b, val_b = data.stdlib_corpus(max_bytes=300_000)
    assert train_a.dtype == np.uint8 and val_a.dtype == np.uint8
    assert np.array_equal(train_a, train_b) and np.array_equal(val_a, val_b)
    assert len(train_a) == 300_000
    assert 0 < len(val_a) <= max(300_000 // 20, 1 << 20)

    root = sysconfig.get_paths()["stdlib"]
    files = data._stdlib_python_files(root)
    assert files == sorted(files)
    assert not any("site-packages" in rel or "dist-packages" in rel for rel in files)
    val_files = [rel for rel in files if zlib.crc32(rel.encode()) % 20 == 0]
    train_files = [rel for rel in files if zlib.crc32(rel.encode()) % 20 != 0]
    assert val_files and train_files
    # The streams are the files' bytes in sorted order, so each split starts with its first file.
    with open(os.path.join(root, train_files[0]), "rb") as handle:
        first_train = handle.read()[:1000]
    with open(os.path.join(root, val_files[0]), "rb") as handle:
        first_val = handle.read()[:1000]
    assert train_a[:len(first_train)].tobytes() == first_train
    assert val_a[:len(first_val)].tobytes() == first_val


def test_stdlib_corpus_rejects_bad_cap():
    with pytest.raises(ValueError, match="data.max_corpus_bytes"):
        data.stdlib_corpus(max_bytes=0)


# ---------------------------------------------------------------- windows


def test_window_dataset_windows():
    tokens = np.arange(23, dtype=np.uint16)
    dataset = data.WindowDataset(tokens, seq_len=5)
    assert dataset.num_windows == (23 - 1) // 5 == 4
    assert torch.equal(dataset[0], torch.arange(0, 6))
    assert torch.equal(dataset[3], torch.arange(15, 21))
    assert dataset[1].dtype == torch.long
    with pytest.raises(IndexError):
        dataset[4]
    # Exactly seq_len + 1 tokens make one window.
    assert data.WindowDataset(np.arange(6), seq_len=5).num_windows == 1
    with pytest.raises(ValueError, match="data.seq_len"):
        data.WindowDataset(np.arange(5), seq_len=5)


def test_synthetic_windows_deterministic_and_in_vocab():
    a = data.SyntheticWindows(vocab_size=37, seq_len=16, num_windows=100, seed=3)
    b = data.SyntheticWindows(vocab_size=37, seq_len=16, num_windows=100, seed=3)
    other_seed = data.SyntheticWindows(vocab_size=37, seq_len=16, num_windows=100, seed=4)
    for k in (0, 1, 99):
        assert a[k].shape == (17,) and a[k].dtype == torch.long
        assert torch.equal(a[k], b[k])
        assert 0 <= int(a[k].min()) and int(a[k].max()) < 37
    assert not torch.equal(a[0], a[1])
    assert not torch.equal(a[0], other_seed[0])
    # Random access order does not matter: window 50 is the same fetched first or last.
    assert torch.equal(data.SyntheticWindows(37, 16, 100, 3)[50], a[50])


# ---------------------------------------------------------------- train_batch


FACTORINGS = [(4, 1, 1), (2, 1, 2), (1, 2, 2), (2, 2, 1), (1, 4, 1), (1, 1, 4)]


@pytest.mark.parametrize("step", [0, 1, 7])
def test_train_batch_union_independent_of_factoring(step):
    dataset = arange_dataset(num_windows=13, seq_len=4)
    unions = []
    for mbs, accum, dp in FACTORINGS:
        per_rank = step_windows(dataset, step, mbs, accum, dp, seed=11)
        flat = [k for ids in per_rank for k in ids]
        assert len(flat) == 4
        unions.append(Counter(flat))
        # The concatenation over ranks is the same ordered global batch, too.
        assert flat == [k for ids in step_windows(dataset, step, 4, 1, 1, seed=11) for k in ids]
    assert all(union == unions[0] for union in unions)


def test_train_batch_ranks_disjoint_and_seed_matters():
    dataset = arange_dataset(num_windows=64, seq_len=3)
    per_rank = step_windows(dataset, step=2, mbs=2, accum=2, dp=4, seed=0)
    seen = [k for ids in per_rank for k in ids]
    assert len(seen) == len(set(seen)) == 16
    other_seed = step_windows(dataset, step=2, mbs=2, accum=2, dp=4, seed=1)
    assert per_rank != other_seed


def test_train_batch_epochs_cover_every_window_once():
    num_windows = 10
    dataset = arange_dataset(num_windows=num_windows, seq_len=2)
    # G = 3 does not divide N = 10, so steps straddle epoch boundaries.
    samples = []
    for step in range(20):
        samples += step_windows(dataset, step, mbs=3, accum=1, dp=1, seed=5)[0]
    epochs = [samples[i:i + num_windows] for i in range(0, 60, num_windows)]
    for epoch in epochs:
        assert sorted(epoch) == list(range(num_windows))
    assert epochs[0] != epochs[1]  # reshuffled every epoch
    assert epochs[0] == list(np.random.default_rng([5, 0]).permutation(num_windows))


def test_train_batch_resume_needs_only_step():
    dataset = arange_dataset(num_windows=50, seq_len=4)
    first = data.train_batch(dataset, 9, 2, 3, 1, 2, seed=42)
    data.train_batch(dataset, 30, 2, 3, 0, 2, seed=42)  # touch other epochs' cache entries
    again = data.train_batch(dataset, 9, 2, 3, 1, 2, seed=42)
    assert len(first) == 3
    for (x1, y1), (x2, y2) in zip(first, again):
        assert torch.equal(x1, x2) and torch.equal(y1, y2)


def test_train_batch_rejects_bad_rank():
    dataset = arange_dataset(num_windows=8, seq_len=2)
    with pytest.raises(ValueError, match="dp_rank"):
        data.train_batch(dataset, 0, 1, 1, 2, 2, seed=0)


# ---------------------------------------------------------------- val_batches


def test_val_batches_fixed_contiguous_and_disjoint():
    dataset = arange_dataset(num_windows=100, seq_len=4)
    per_rank = []
    for rank in range(3):
        batches = validation.val_batches(dataset, num_batches=2, micro_batch_size=5, dp_rank=rank, dp_size=3)
        assert len(batches) == 2
        ids = []
        for inputs, targets in batches:
            assert inputs.shape == (5, 4)
            assert torch.equal(targets, inputs + 1)
            ids += window_ids(dataset, inputs)
        per_rank.append(ids)
    assert per_rank[0] == list(range(0, 10))
    assert per_rank[1] == list(range(10, 20))
    assert per_rank[2] == list(range(20, 30))
    # Same windows overall whatever dp_size is.
    single = validation.val_batches(dataset, num_batches=6, micro_batch_size=5, dp_rank=0, dp_size=1)
    assert [k for x, _ in single for k in window_ids(dataset, x)] == list(range(30))


def test_val_batches_wrap_around_small_set():
    dataset = arange_dataset(num_windows=3, seq_len=2)
    batches = validation.val_batches(dataset, num_batches=2, micro_batch_size=2, dp_rank=0, dp_size=1)
    assert [k for x, _ in batches for k in window_ids(dataset, x)] == [0, 1, 2, 0]


# ---------------------------------------------------------------- token files


@pytest.mark.parametrize("dtype", ["uint16", "uint32"])
def test_token_file_round_trip(tmp_path, dtype):
    high = 65535 if dtype == "uint16" else 4_000_000_000
    tokens = np.array([0, 1, 2, high, 7, high - 1, 3], dtype="<" + np.dtype(dtype).str[1:])
    path = tmp_path / "train.bin"
    tokens.tofile(path)
    loaded = data.token_file(str(path), dtype)
    assert isinstance(loaded, np.memmap)
    assert np.array_equal(loaded, tokens)
    window = data.WindowDataset(loaded, seq_len=3)[1]
    assert window.tolist() == [high, 7, high - 1, 3]


def test_token_file_errors_name_the_key(tmp_path):
    with pytest.raises(ValueError, match="data.val_path"):
        data.token_file(str(tmp_path / "missing.bin"), "uint16", "data.val_path")
    odd = tmp_path / "odd.bin"
    odd.write_bytes(b"\x00\x01\x02")
    with pytest.raises(ValueError, match="data.train_path.*multiple of 2"):
        data.token_file(str(odd), "uint16")
    with pytest.raises(ValueError, match="data.token_dtype"):
        data.token_file(str(odd), "int8")


def test_read_meta(tmp_path):
    assert data.read_meta(str(tmp_path)) is None
    (tmp_path / "meta.json").write_text(json.dumps({"vocab_size": 300, "dtype": "uint16"}))
    assert data.read_meta(str(tmp_path))["vocab_size"] == 300
    assert data.read_meta(str(tmp_path / "train.bin"))["dtype"] == "uint16"


# ---------------------------------------------------------------- build_datasets


def test_build_datasets_sources(tmp_path):
    train, val, vocab = data.build_datasets("bytes", 64, 1000, 0, None, None, "uint16", 100_000)
    assert vocab == 256 and train.num_windows == (100_000 - 1) // 64 and val.num_windows > 0

    train, val, vocab = data.build_datasets("synthetic", 8, 50, 1, None, None, "uint16", 1)
    assert vocab == 50 and train.num_windows == 1 << 20 and val.num_windows == 1024
    assert not torch.equal(train[0], val[0])

    np.arange(100, dtype="<u2").tofile(tmp_path / "train.bin")
    np.arange(40, dtype="<u2").tofile(tmp_path / "val.bin")
    args = (str(tmp_path / "train.bin"), str(tmp_path / "val.bin"), "uint16", 1)
    train, val, vocab = data.build_datasets("tokens", 9, 777, 0, *args)
    assert vocab == 777 and train.num_windows == 11 and val.num_windows == 4
    (tmp_path / "meta.json").write_text(json.dumps({"vocab_size": 120, "dtype": "uint16"}))
    assert data.build_datasets("tokens", 9, 777, 0, *args)[2] == 120


@pytest.mark.parametrize("source, seq_len, train_path, val_path, dtype, key", [
    ("csv", 8, None, None, "uint16", "data.source"),
    ("tokens", 8, None, "v.bin", "uint16", "data.train_path"),
    ("tokens", 8, "MISSING", None, "uint16", "data.val_path"),
    ("tokens", 8, "MISSING", "v.bin", "uint16", "data.train_path"),
    ("bytes", 8, "t.bin", None, "uint16", "data.train_path"),
    ("synthetic", 0, None, None, "uint16", "data.seq_len"),
    ("tokens", 8, "TRAIN", "VAL", "uint8", "data.token_dtype"),
    ("tokens", 8, "TRAIN", "VAL", "uint32", "data.token_dtype"),  # meta.json says uint16
    ("tokens", 50, "TRAIN", "VAL", "uint16", "data.seq_len"),  # val split too short
])
def test_build_datasets_errors_name_the_key(tmp_path, source, seq_len, train_path, val_path, dtype, key):
    np.arange(100, dtype="<u2").tofile(tmp_path / "train.bin")
    np.arange(40, dtype="<u2").tofile(tmp_path / "val.bin")
    (tmp_path / "meta.json").write_text(json.dumps({"vocab_size": 100, "dtype": "uint16"}))
    paths = {"TRAIN": str(tmp_path / "train.bin"), "VAL": str(tmp_path / "val.bin"),
             "MISSING": str(tmp_path / "nope.bin")}
    with pytest.raises(ValueError, match=key) as raised:
        data.build_datasets(source, seq_len, 100, 0, paths.get(train_path, train_path),
                            paths.get(val_path, val_path), dtype, 10_000)
    assert "\n" not in str(raised.value)


# ---------------------------------------------------------------- tokenize command


def write_docs(root, docs: dict[str, str]) -> None:
    for rel, text in docs.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text(text, encoding="utf-8")


def score(rel: str) -> float:
    return zlib.crc32(rel.encode()) / 2**32


def test_tokenize_bytes_end_to_end(tmp_path, capsys):
    docs = {"a.txt": "alpha\n", "b.txt": "béta ✓\nline two\n", "sub/c.txt": "gamma"}
    write_docs(tmp_path / "corpus", docs)
    write_docs(tmp_path / "corpus", {"skip.md": "not text glob", ".hidden/d.txt": "hidden"})
    ranked = sorted(docs, key=score)
    # A fraction between the two lowest scores sends exactly the lowest-scoring file to val.
    fraction = (score(ranked[0]) + score(ranked[1])) / 2
    out = tmp_path / "out"
    argv = [str(tmp_path / "corpus"), "--out", str(out), "--val-fraction", str(fraction), "--eos-id", "0"]
    assert tokenize.main(argv) == 0

    def expected(rels):  # documents in sorted relative-path order, each followed by EOS
        return b"".join(docs[rel].encode() + b"\x00" for rel in sorted(rels))
    train = np.fromfile(out / "train.bin", dtype="<u2")
    val = np.fromfile(out / "val.bin", dtype="<u2")
    assert bytes(train.astype(np.uint8)) == expected(ranked[1:])
    assert bytes(val.astype(np.uint8)) == expected(ranked[:1])
    meta = json.loads((out / "meta.json").read_text())
    assert meta["vocab_size"] == 256 and meta["dtype"] == "uint16" and meta["tokenizer"] == "bytes"
    assert meta["num_tokens"] == {"train": len(train), "val": len(val)}
    assert not list(out.glob("*.partial"))
    summary = capsys.readouterr().out.strip().splitlines()
    assert len(summary) == 1 and f"{len(train)} train" in summary[0] and "uint16" in summary[0]
    # The output is exactly what data.source=tokens consumes.
    train_set, val_set, vocab = data.build_datasets(
        "tokens", 4, 1000, 0, str(out / "train.bin"), str(out / "val.bin"), "uint16", 1)
    assert vocab == 256 and torch.equal(train_set[0], torch.tensor(list(train[:5]), dtype=torch.long))


def test_read_chunks_keep_characters_whole(tmp_path):
    text = "héllo wörld ✓✓✓\nsecond line ✓\n" + "ü" * 40 + "\nend"
    path = tmp_path / "doc.txt"
    path.write_text(text, encoding="utf-8")
    for chunk_bytes in (1, 3, 7, 1 << 20):
        pieces = list(tokenize.read_chunks(str(path), chunk_bytes))
        assert b"".join(pieces) == text.encode()
        for piece in pieces:
            piece.decode("utf-8")  # raises if a character was split


def make_tokenizer(path) -> int:
    """A tiny word-level tokenizer.json; returns the id of its [EOS] token."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers
    tokenizer = Tokenizer(models.WordLevel(unk_token="[UNK]"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    trainer = trainers.WordLevelTrainer(special_tokens=["[UNK]", "[EOS]"])
    tokenizer.train_from_iterator(["the cat sat", "on the mat", "the end"], trainer=trainer)
    tokenizer.save(str(path))
    return tokenizer.token_to_id("[EOS]")


def test_tokenize_with_tokenizer_json(tmp_path):
    pytest.importorskip("tokenizers")
    from tokenizers import Tokenizer
    eos = make_tokenizer(tmp_path / "tokenizer.json")
    reference = Tokenizer.from_file(str(tmp_path / "tokenizer.json"))
    docs = {"one.txt": "the cat sat\non the mat\n", "two.txt": "the end dog\n"}
    write_docs(tmp_path / "corpus", docs)
    out = tmp_path / "out"
    argv = [str(tmp_path / "corpus"), "--out", str(out), "--tokenizer", str(tmp_path / "tokenizer.json"),
            "--val-fraction", "0", "--eos-id", str(eos)]
    assert tokenize.main(argv) == 0
    expected = []
    for rel in sorted(docs):
        expected += reference.encode(docs[rel], add_special_tokens=False).ids + [eos]
    assert np.fromfile(out / "train.bin", dtype="<u2").tolist() == expected
    assert os.path.getsize(out / "val.bin") == 0
    meta = json.loads((out / "meta.json").read_text())
    assert meta["vocab_size"] == reference.get_vocab_size() and meta["dtype"] == "uint16"
    assert meta["num_tokens"] == {"train": len(expected), "val": 0}
    assert meta["tokenizer"].endswith("tokenizer.json")
    # Tiny chunks force cuts before spaces too; a whitespace tokenizer must not notice.
    small = tokenize.tokenize_files([str(tmp_path / "corpus")], str(tmp_path / "small"),
                                    tokenize.HFEncoder(str(tmp_path / "tokenizer.json")),
                                    0.0, eos, "*.txt", chunk_bytes=2)
    assert small["num_tokens"]["train"] == len(expected)
    assert np.fromfile(tmp_path / "small" / "train.bin", dtype="<u2").tolist() == expected


def test_token_dtype_widens_for_large_vocab():
    assert tokenize.token_dtype(256) == "uint16"
    assert tokenize.token_dtype(65536) == "uint16"
    assert tokenize.token_dtype(65537) == "uint32"


@pytest.mark.parametrize("argv", [
    ["MISSING", "--out", "OUT"],
    ["CORPUS"],  # no --out
    ["CORPUS", "--out", "OUT", "--val-fraction", "1.5"],
    ["CORPUS", "--out", "OUT", "--eos-id", "256"],
    ["CORPUS", "--out", "OUT", "--tokenizer", "MISSING"],
    ["CORPUS", "--out", "OUT", "--glob", "*.nothing"],
    ["CORPUS/a.txt", "--out", "OUT"],  # one document cannot be split
    ["CORPUS", "--out", "CORPUS/a.txt"],  # --out is a file
    ["CORPUS", "--out", "OUT", "--bogus"],
])
def test_tokenize_bad_input_exits_2_with_one_line(tmp_path, capsys, argv):
    write_docs(tmp_path / "corpus", {"a.txt": "x", "b.txt": "y"})
    names = {"CORPUS": str(tmp_path / "corpus"), "OUT": str(tmp_path / "out"),
             "MISSING": str(tmp_path / "missing")}
    for name, value in names.items():
        argv = [arg.replace(name, value) for arg in argv]
    assert tokenize.main(argv) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    lines = captured.err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ")
    assert not (tmp_path / "out" / "train.bin").exists()


def test_tokenize_runs_as_module(tmp_path):
    import subprocess
    import sys
    result = subprocess.run([sys.executable, "-m", "trainer.tokenize", str(tmp_path / "nope"), "--out",
                             str(tmp_path / "out")], capture_output=True, text=True,
                            cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    assert result.returncode == 2 and result.stderr.startswith("error: ") and "Traceback" not in result.stderr
