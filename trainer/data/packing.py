"""Documents into fixed windows of `data.seq_len` tokens, and the windows read back.

A document of n tokens gives n - 1 training positions: inputs are its tokens but the last,
targets the tokens after them (the ignore index where a target is not to be learned), positions
0 .. n - 2. Documents sit side by side in a window; positions restart at each, which is how the
model knows where one ends (its attention never crosses a document, trainer/models/), and no
target ever predicts a document's first token from the one before it.

- `concat`: text. Documents follow each other and are cut at window edges; the part of a
  document in the next window starts again at position 0.
- `best_fit`: chat. A conversation is never cut: each goes whole into the fullest window it
  still fits (best-fit decreasing), and what is left of a window is padding (ignored targets).
  A conversation longer than a window is truncated to it (`data.overlong=truncate`) or dropped
  (`drop`), and counted either way.
- no packing (`data.packing=false`): a document per window, padded.

Windows are written once as .npy arrays (fixed-size int32 rows, memory-mapped, so any window is
one slice and a run's memory does not grow with the dataset) with their supervised and real
token counts, which make the global loss normaliser of a step known before it runs.
"""

from __future__ import annotations

import bisect
import os
from typing import Iterable, Iterator, Optional, Sequence

import numpy as np
import torch

from trainer.data.cache_files import reserve
from trainer.data.chat import IGNORE

Doc = tuple[np.ndarray, np.ndarray]  # token ids [n], supervised [n] (whether to learn token i)
FILES = ("inputs", "targets", "positions", "counts")
# (rows [3, seq_len]: inputs, targets, positions; how many of them are real tokens, not padding)
Window = tuple[np.ndarray, int]


def training_rows(ids: np.ndarray, supervised: np.ndarray) -> tuple[np.ndarray, ...]:
    """(inputs, targets, positions) of one document: n - 1 positions."""
    targets = np.where(supervised[1:], ids[1:], IGNORE)
    return ids[:-1], targets, np.arange(len(ids) - 1)


def concat_windows(docs: Iterable[Doc], seq_len: int, pad_id: int) -> Iterator[Window]:
    """Windows of documents cut at window edges; the last, partly filled one is padded."""
    buffer = np.empty((3, seq_len), dtype=np.int64)
    filled = 0
    for ids, supervised in docs:
        rows = np.stack(training_rows(ids, supervised))
        while rows.shape[1]:
            take = min(seq_len - filled, rows.shape[1])
            buffer[:2, filled:filled + take] = rows[:2, :take]
            # A piece carried into the next window starts there as a document of its own.
            buffer[2, filled:filled + take] = np.arange(take)
            filled += take
            rows = rows[:, take:]
            if filled == seq_len:
                yield buffer.copy(), seq_len
                filled = 0
    if filled:
        yield _padded(buffer[:, :filled], seq_len, pad_id), filled


def concat_count(lengths: Iterable[int], seq_len: int) -> int:
    """How many windows `concat_windows` makes of documents of these token lengths."""
    positions = sum(max(0, n - 1) for n in lengths)
    return int(-(-positions // seq_len))


def _padded(rows: np.ndarray, seq_len: int, pad_id: int) -> np.ndarray:
    """Fill a window's tail: pad inputs, ignored targets, positions of a document of its own."""
    window = np.empty((3, seq_len), dtype=np.int64)
    n = rows.shape[1]
    window[:, :n] = rows
    window[0, n:], window[1, n:], window[2, n:] = pad_id, IGNORE, np.arange(seq_len - n)
    return window


def fit_length(length: int, seq_len: int, overlong: str) -> int:
    """Training positions a document keeps: all, seq_len (truncated), or 0 (dropped)."""
    if length <= seq_len:
        return length
    return seq_len if overlong == "truncate" else 0


def best_fit_bins(lengths: Sequence[int], seq_len: int) -> list[list[int]]:
    """Document indices per window: longest first, each into the window with the least room
    that still holds it (a new window if none does). Lengths must be <= seq_len."""
    order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
    bins: list[list[int]] = []
    room_keys: list[int] = []  # sorted rooms that some window has
    by_room: dict[int, list[int]] = {}  # room -> windows with exactly that room
    for index in order:
        need = lengths[index]
        if need == 0:
            continue
        at = bisect.bisect_left(room_keys, need)
        if at == len(room_keys):
            bins.append([])
            window, room = len(bins) - 1, seq_len
        else:
            room = room_keys[at]
            window = by_room[room].pop()
            if not by_room[room]:
                del by_room[room]
                room_keys.pop(at)
        bins[window].append(index)
        room -= need
        if room > 0:
            if room not in by_room:
                bisect.insort(room_keys, room)
                by_room[room] = []
            by_room[room].append(window)
    return bins


def bin_window(docs: Sequence[Doc], seq_len: int, pad_id: int) -> Window:
    """One window of whole documents (each cut to seq_len positions at most), padded."""
    parts = [np.stack(training_rows(ids, sup))[:, :seq_len] for ids, sup in docs]
    rows = np.concatenate(parts, axis=1) if parts else np.empty((3, 0), dtype=np.int64)
    return _padded(rows, seq_len, pad_id), rows.shape[1]


def write_windows(folder: str, windows: Iterable[Window], num_windows: int,
                  seq_len: int, cache_dir: str) -> None:
    """The windows as memory-mappable .npy files, and per window (supervised, real) counts.
    Each file's room is reserved before it is mapped: a full `cache_dir` is then one error
    (CacheFull) rather than SIGBUS while the map is written."""
    os.makedirs(folder, exist_ok=True)
    arrays = {}
    for name in FILES[:3]:
        path = os.path.join(folder, f"{name}.npy")
        arrays[name] = np.lib.format.open_memmap(path, mode="w+", dtype=np.int32,
                                                 shape=(num_windows, seq_len))
        reserve(path, os.path.getsize(path), cache_dir)
    counts = np.zeros((num_windows, 2), dtype=np.int64)
    written = 0
    for k, (window, real) in enumerate(windows):
        for row, name in enumerate(FILES[:3]):
            arrays[name][k] = window[row]
        counts[k] = ((window[1] != IGNORE).sum(), real)
        written += 1
    if written != num_windows:
        raise RuntimeError(f"packing wrote {written} windows, expected {num_windows}")
    for array in arrays.values():
        array.flush()
    np.save(os.path.join(folder, "counts.npy"), counts)


class PackedWindows:
    """Windows written by `write_windows`, read by index: (inputs, targets, positions)."""

    def __init__(self, folder: str) -> None:
        self.folder = folder
        self.inputs, self.targets, self.positions = (
            np.load(os.path.join(folder, f"{name}.npy"), mmap_mode="r") for name in FILES[:3])
        self.counts = np.load(os.path.join(folder, "counts.npy"))
        self.num_windows, self.seq_len = self.inputs.shape
        self.identity: Optional[dict] = None  # what a checkpoint records (documents.py sets it)

    def __len__(self) -> int:
        return self.num_windows

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        if not 0 <= index < self.num_windows:
            raise IndexError(f"window {index} out of range [0, {self.num_windows})")
        return tuple(torch.from_numpy(np.asarray(a[index]).astype(np.int64))
                     for a in (self.inputs, self.targets, self.positions))

    def supervised_and_real(self, window_ids: np.ndarray) -> tuple[int, int]:
        """Supervised targets and real (not padding) tokens of these windows."""
        sums = self.counts[np.asarray(window_ids, dtype=np.int64)].sum(axis=0)
        return int(sums[0]), int(sums[1])
