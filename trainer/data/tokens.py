"""Token sources, fixed-length windows and the step-indexed sampler.

Every source is a flat 1-D token stream cut into non-overlapping windows of
seq_len + 1 tokens (inputs plus the one-token-shifted targets). Which windows a
rank reads at an optimizer step is a pure function of (step, batch shape,
rank, seed), so a resumed run needs nothing but the step number and changing
how the global batch is factored across ranks leaves the data unchanged.
"""

from __future__ import annotations

import functools
import json
import os
import sysconfig
import threading
import zlib
from typing import Protocol

import numpy as np
import torch

BYTE_VOCAB_SIZE = 256
TOKEN_DTYPES = ("uint16", "uint32")
# A file lands in the stdlib corpus' validation split when crc32(relpath) % 20 == 0 (~5%).
_STDLIB_VAL_MODULUS = 20
# Enough validation text for a stable loss estimate even when the train cap is tiny.
_MIN_VAL_BYTES = 1 << 20
SYNTHETIC_TRAIN_WINDOWS = 1 << 20
SYNTHETIC_VAL_WINDOWS = 1024

Batch = tuple[torch.Tensor, torch.Tensor]


class Windows(Protocol):
    """What the samplers need from a dataset: a count and indexable windows."""

    num_windows: int

    def __getitem__(self, index: int): ...  # a token window, or an (image, label) pair


# ---------------------------------------------------------------- sources


def _stdlib_python_files(root: str) -> list[str]:
    """Relative posix paths of the stdlib's *.py files, third-party packages excluded."""
    skipped_dirs = {"site-packages", "dist-packages", "__pycache__"}
    relpaths = []
    for dirpath, dirnames, filenames in os.walk(root):
        # Pruning in place keeps os.walk out of site-packages, which can dwarf the stdlib.
        dirnames[:] = [name for name in dirnames if name not in skipped_dirs]
        for name in filenames:
            if name.endswith(".py"):
                rel = os.path.relpath(os.path.join(dirpath, name), root)
                relpaths.append(rel.replace(os.sep, "/"))
    return sorted(relpaths)


def stdlib_corpus(max_bytes: int) -> tuple[np.ndarray, np.ndarray]:
    """Byte-level (train, val) corpus built from the Python standard library's sources.

    The split is per file (crc32 of the relative path) so no file straddles both
    splits; the train split is capped at max_bytes and validation at
    max(max_bytes // 20, 1 MiB). Files are read only until both caps are met.
    """
    if max_bytes < 1:
        raise ValueError(f"data.max_corpus_bytes must be >= 1, got {max_bytes}")
    root = sysconfig.get_paths()["stdlib"]
    caps = {"train": max_bytes, "val": max(max_bytes // _STDLIB_VAL_MODULUS, _MIN_VAL_BYTES)}
    buffers = {"train": bytearray(), "val": bytearray()}
    for rel in _stdlib_python_files(root):
        split = "val" if zlib.crc32(rel.encode("utf-8")) % _STDLIB_VAL_MODULUS == 0 else "train"
        room = caps[split] - len(buffers[split])
        if room > 0:
            with open(os.path.join(root, rel), "rb") as handle:
                # Read whole then slice: read(room) would preallocate `room` bytes for a huge cap.
                buffers[split] += handle.read()[:room]
        if all(len(buffers[name]) >= caps[name] for name in buffers):
            break
    if not buffers["train"] or not buffers["val"]:
        raise ValueError(f"data.source=bytes: found no Python sources under the stdlib directory {root}")
    return (np.frombuffer(buffers["train"], dtype=np.uint8),
            np.frombuffer(buffers["val"], dtype=np.uint8))


def token_file(path: str, dtype: str, config_key: str = "data.train_path") -> np.ndarray:
    """Read-only memmap of a flat little-endian token file (nanoGPT / Megatron .bin layout).

    config_key names the setting that supplied path, so errors point at what to fix.
    """
    if dtype not in TOKEN_DTYPES:
        raise ValueError(f"data.token_dtype must be one of {TOKEN_DTYPES}, got {dtype!r}")
    if not os.path.isfile(path):
        raise ValueError(f"{config_key}: no such token file: {path}")
    # Explicit little-endian so files written on one host read the same on any other.
    np_dtype = np.dtype(dtype).newbyteorder("<")
    size = os.path.getsize(path)
    if size % np_dtype.itemsize != 0:
        raise ValueError(
            f"{config_key}: {path} is {size} bytes, not a multiple of {np_dtype.itemsize} "
            f"({dtype}); is data.token_dtype right?")
    if size == 0:
        # np.memmap cannot map an empty file, and an empty split is a data bug anyway.
        raise ValueError(f"{config_key}: token file is empty: {path}")
    return np.memmap(path, dtype=np_dtype, mode="r")


def read_meta(dir_or_file: str) -> dict | None:
    """The tokenize command's meta.json beside a token file (or in a directory), if any."""
    directory = dir_or_file if os.path.isdir(dir_or_file) else os.path.dirname(dir_or_file)
    meta_path = os.path.join(directory, "meta.json")
    if not os.path.isfile(meta_path):
        return None
    try:
        with open(meta_path, encoding="utf-8") as handle:
            meta = json.load(handle)
    except json.JSONDecodeError as error:
        raise ValueError(f"{meta_path} is not valid JSON: {error}") from error
    if not isinstance(meta, dict):
        raise ValueError(f"{meta_path} must hold a JSON object")
    return meta


# ---------------------------------------------------------------- windows


class WindowDataset:
    """Non-overlapping windows of seq_len + 1 tokens over a flat token array.

    Window k starts at k * seq_len, so consecutive windows share one boundary
    token: the last target of window k is the first input of window k + 1.
    """

    def __init__(self, tokens: np.ndarray, seq_len: int) -> None:
        if tokens.ndim != 1:
            raise ValueError(f"token array must be 1-D, got shape {tokens.shape}")
        if seq_len < 1:
            raise ValueError(f"data.seq_len must be >= 1, got {seq_len}")
        self.tokens = tokens
        self.seq_len = seq_len
        self.num_windows = (len(tokens) - 1) // seq_len
        if self.num_windows <= 0:
            raise ValueError(
                f"data.seq_len={seq_len} needs at least {seq_len + 1} tokens, "
                f"but the split has {len(tokens)}")

    def __len__(self) -> int:
        return self.num_windows

    def __getitem__(self, index: int) -> torch.Tensor:
        if not 0 <= index < self.num_windows:
            raise IndexError(f"window {index} out of range [0, {self.num_windows})")
        start = index * self.seq_len
        # astype copies out of the (possibly read-only, memmapped) array into int64.
        window = np.asarray(self.tokens[start:start + self.seq_len + 1]).astype(np.int64)
        return torch.from_numpy(window)


class SyntheticWindows:
    """Uniform random windows for benchmarks; window k depends only on (seed, stream, k).

    Keying the generator by index means any window is produced in O(1) with no
    state, so samplers can jump to any step exactly as with real data.
    """

    def __init__(self, vocab_size: int, seq_len: int, num_windows: int, seed: int,
                 stream: int = 0) -> None:
        if vocab_size < 1:
            raise ValueError(f"model.vocab_size must be >= 1 for synthetic data, got {vocab_size}")
        if seq_len < 1:
            raise ValueError(f"data.seq_len must be >= 1, got {seq_len}")
        if num_windows < 1:
            raise ValueError(f"synthetic num_windows must be >= 1, got {num_windows}")
        self.vocab_size = vocab_size
        self.seq_len = seq_len
        self.num_windows = num_windows
        self.seed = seed
        self.stream = stream

    def __len__(self) -> int:
        return self.num_windows

    def __getitem__(self, index: int) -> torch.Tensor:
        if not 0 <= index < self.num_windows:
            raise IndexError(f"window {index} out of range [0, {self.num_windows})")
        rng = np.random.default_rng([self.seed, self.stream, index])
        window = rng.integers(0, self.vocab_size, size=self.seq_len + 1, dtype=np.int64)
        return torch.from_numpy(window)


# ---------------------------------------------------------------- sampling


# An epoch's order is held a part at a time: a run holds 2^16 entries of it (256 KiB), or a
# 64th of an epoch on a corpus of over 4M windows, not 4 bytes for every window of the corpus
# (4 MiB for data=synthetic's 2^20, 400 MiB for 10^8 windows) from the first step to the last.
# Each part is cut from the whole order drawn again, so a rank redraws it once per part it enters.
ORDER_PART_MIN = 1 << 16
ORDER_PARTS_MAX = 64


def order_part_size(num_windows: int) -> int:
    return max(ORDER_PART_MIN, -(-num_windows // ORDER_PARTS_MAX))


@functools.lru_cache(maxsize=4)
def _order_part(seed: int, epoch: int, num_windows: int, part: int) -> np.ndarray:
    # A pure function of its arguments, so memoising it cannot change results; four entries
    # cover a step that straddles a part and an epoch boundary at once. Shuffling an int32
    # arange draws what Generator.permutation(num_windows) draws (it shuffles an arange), in
    # half the memory (tests/test_data.py compares the two).
    dtype = np.int32 if num_windows <= np.iinfo(np.int32).max else np.int64
    order = np.arange(num_windows, dtype=dtype)
    np.random.default_rng([seed, epoch]).shuffle(order)
    size = order_part_size(num_windows)
    return order[part * size:(part + 1) * size].copy()


_ORDER_LOCK = threading.Lock()  # read-ahead threads: one draw of a part, not one each


def _epoch_order(seed: int, epoch: int, num_windows: int, positions: np.ndarray) -> np.ndarray:
    """perm_epoch[positions]: the windows at these positions of the epoch's order."""
    size = order_part_size(num_windows)
    parts = positions // size
    out = np.empty_like(positions)
    for part in _distinct(parts):
        in_part = parts == part
        with _ORDER_LOCK:
            order = _order_part(seed, epoch, num_windows, int(part))
        out[in_part] = order[positions[in_part] - part * size]
    return out


def _distinct(values: np.ndarray) -> list[int]:
    """The distinct values of a batch's few, ascending. Not np.unique: its first call imports
    numpy.ma, 1.3 MiB held by every rank for the rest of the run (measured 2026-12-02)."""
    return sorted(set(values.tolist()))


def stack_windows(dataset: Windows, window_ids: np.ndarray,
                  draws: np.ndarray | None = None) -> Batch:
    """The batch of these windows; `draws` (global sample positions) let a dataset with a
    `sample(window, draw)` method vary a training sample by where it falls (augmentation)."""
    if draws is not None and hasattr(dataset, "sample"):
        items = [dataset.sample(int(k), int(g)) for k, g in zip(window_ids, draws)]
    else:
        items = [dataset[int(k)] for k in window_ids]
    if isinstance(items[0], tuple) and len(items[0]) == 3:  # packed windows (data/packing.py)
        return tuple(torch.stack([item[i] for item in items]) for i in range(3))
    if isinstance(items[0], tuple):  # (image, label) samples (trainer/data/images.py)
        return (torch.stack([x for x, _ in items]),
                torch.tensor([y for _, y in items], dtype=torch.long))
    windows = torch.stack(items)  # token windows: inputs, and targets shifted by one
    return windows[:, :-1].contiguous(), windows[:, 1:].contiguous()


def check_rank(dp_rank: int, dp_size: int) -> None:
    if dp_size < 1 or not 0 <= dp_rank < dp_size:
        raise ValueError(f"need 0 <= dp_rank < dp_size, got dp_rank={dp_rank}, dp_size={dp_size}")


def train_batch(dataset: Windows, step: int, micro_batch_size: int, grad_accum: int,
                dp_rank: int, dp_size: int, seed: int) -> list[Batch]:
    """The grad_accum micro-batches (inputs, targets) of one rank at optimizer step `step`.

    Global sample g = step * G + j (G = mbs * grad_accum * dp_size) reads window
    perm_e[g % N] with e = g // N; rank r owns j in [r*mbs*accum, (r+1)*mbs*accum)
    and micro-batch m the next mbs of those. Hence the samples of a step do not
    depend on how G is factored, and every epoch visits each window exactly once.
    """
    if micro_batch_size < 1 or grad_accum < 1:
        raise ValueError(f"micro_batch_size and grad_accum must be >= 1, "
                         f"got {micro_batch_size} and {grad_accum}")
    if step < 0:
        raise ValueError(f"step must be >= 0, got {step}")
    check_rank(dp_rank, dp_size)
    per_rank = micro_batch_size * grad_accum
    first = step * per_rank * dp_size + dp_rank * per_rank
    samples = np.arange(first, first + per_rank, dtype=np.int64)
    window_ids = windows_of(samples, dataset.num_windows, seed)
    return [stack_windows(dataset, window_ids[m * micro_batch_size:(m + 1) * micro_batch_size],
                   samples[m * micro_batch_size:(m + 1) * micro_batch_size])
            for m in range(grad_accum)]


def windows_of(samples: np.ndarray, num_windows: int, seed: int) -> np.ndarray:
    """The window each global sample reads: perm_e[g % N] with e = g // N."""
    epochs = samples // num_windows
    window_ids = np.empty_like(samples)
    for epoch in _distinct(epochs):
        in_epoch = epochs == epoch
        window_ids[in_epoch] = _epoch_order(seed, int(epoch), num_windows,
                                            samples[in_epoch] % num_windows)
    return window_ids


def step_counts(dataset, step: int, global_batch: int, seed: int) -> tuple[int, int] | None:
    """(supervised targets, real tokens) of the whole global batch of step `step`, the same on
    every rank (datasets that count them: packed windows); None for the others."""
    if not hasattr(dataset, "supervised_and_real"):
        return None
    samples = np.arange(step * global_batch, (step + 1) * global_batch, dtype=np.int64)
    return dataset.supervised_and_real(windows_of(samples, dataset.num_windows, seed))


# ---------------------------------------------------------------- assembly


def _token_datasets(seq_len: int, vocab_size: int, train_path: str | None, val_path: str | None,
                    token_dtype: str) -> tuple[WindowDataset, WindowDataset, int]:
    if not train_path:
        raise ValueError("data.train_path is required when data.source=tokens")
    if not val_path:
        raise ValueError("data.val_path is required when data.source=tokens")
    meta = read_meta(train_path)
    data_vocab_size = vocab_size
    if meta is not None:
        meta_dtype = meta.get("dtype")
        if meta_dtype is not None and meta_dtype != token_dtype:
            # Reading with the wrong width yields garbage ids rather than an error, so stop here.
            raise ValueError(
                f"data.token_dtype={token_dtype} but the meta.json beside {train_path} "
                f"says {meta_dtype}; set data.token_dtype={meta_dtype}")
        if meta.get("vocab_size") is not None:
            data_vocab_size = int(meta["vocab_size"])
    train = WindowDataset(token_file(train_path, token_dtype, "data.train_path"), seq_len)
    val = WindowDataset(token_file(val_path, token_dtype, "data.val_path"), seq_len)
    return train, val, data_vocab_size


def build_datasets(source: str, seq_len: int, vocab_size: int, seed: int,
                   train_path: str | None, val_path: str | None, token_dtype: str,
                   max_corpus_bytes: int) -> tuple[Windows, Windows, int]:
    """(train, val, data_vocab_size) for data.source in {'bytes', 'tokens', 'synthetic'}.

    vocab_size is only a fallback: byte data is always 256, token files use
    their meta.json when present, synthetic data uses vocab_size as given.
    """
    if seq_len < 1:
        raise ValueError(f"data.seq_len must be >= 1, got {seq_len}")
    if source == "tokens":
        return _token_datasets(seq_len, vocab_size, train_path, val_path, token_dtype)
    # Paths are meaningless for the other sources; silently ignoring them would train
    # on the wrong data when someone forgot to switch data.source.
    for key, value in (("data.train_path", train_path), ("data.val_path", val_path)):
        if value:
            raise ValueError(f"{key} is set but data.source={source}; set data.source=tokens")
    if source == "bytes":
        train_tokens, val_tokens = stdlib_corpus(max_corpus_bytes)
        return (WindowDataset(train_tokens, seq_len), WindowDataset(val_tokens, seq_len),
                BYTE_VOCAB_SIZE)
    if source != "synthetic":  # the factory's names (trainer/data/factory.py) choose the rest
        raise ValueError(f"data.source={source} is not read as token windows")
    if vocab_size < 1:
        raise ValueError(f"model.vocab_size must be >= 1 for data.source=synthetic, got {vocab_size}")
    train = SyntheticWindows(vocab_size, seq_len, SYNTHETIC_TRAIN_WINDOWS, seed, stream=0)
    # A separate stream keeps validation windows distinct from training windows.
    val = SyntheticWindows(vocab_size, seq_len, SYNTHETIC_VAL_WINDOWS, seed, stream=1)
    return train, val, vocab_size
