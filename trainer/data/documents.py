"""`data=text` and `data=chat`: documents from jsonl or parquet files (a file, a folder or a glob),
a saved `datasets` dataset or a dataset name, read with the `datasets` library (Arrow,
memory-mapped), tokenized once with the model's Hugging Face tokenizer, packed into windows
(trainer/data/packing.py) and cached under `data.cache_dir` in a folder keyed by the files, the
tokenizer and the settings: a second run starts without tokenizing again.

One process per node prepares (`preparer`), under a file lock so that nodes sharing a file
system do it once; the others wait for the folder to appear. A folder appears whole or not at
all (written under a temporary name, then renamed).
"""

from __future__ import annotations

import fcntl
import glob
import hashlib
import json
import logging
import os
import shutil
import time
from dataclasses import asdict
from typing import Optional

from trainer.data.cache_files import (TEMP_MARK, describe, full, is_full, problem,
                                      remove_dead_temps)
from trainer.data.identity import identity
from trainer.data.interrupt import stop_signals
from trainer.data.packing import PackedWindows
from trainer.data.sources import (DataError, DocSettings, data_files, is_saved_dataset,
                                  load_tokenizer)
from trainer.data.tokenize_docs import prepare

log = logging.getLogger("trainer")
# Of the cached folder's layout: a change here makes every key new. 2: files checked by size
# and checksum, ids by their maximum (2026-12-03).
VERSION = 2


def tokenizer_fingerprint(tokenizer) -> str:
    """What of a tokenizer decides the ids: its vocabulary and rules, template and specials."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    text = backend.to_str() if backend is not None else repr(tokenizer.get_vocab())
    extra = json.dumps([tokenizer.chat_template, tokenizer.bos_token_id, tokenizer.eos_token_id,
                        tokenizer.pad_token_id, type(tokenizer).__name__])
    return hashlib.sha256((text + extra).encode()).hexdigest()


def source_fingerprint(path: str) -> list:
    """The files behind `path` by name, size and modification time (or the name alone)."""
    if is_saved_dataset(path):
        files = sorted(glob.glob(os.path.join(path, "**", "*"), recursive=True))
    else:
        files = data_files(path)
    if not files:
        return [path]
    return [[os.path.abspath(f), os.path.getsize(f), os.stat(f).st_mtime_ns]
            for f in files if os.path.isfile(f)]


def cache_key(path: str, val_path: Optional[str], tokenizer, settings: DocSettings) -> str:
    text = json.dumps({"version": VERSION, "train": source_fingerprint(path),
                       "val": source_fingerprint(val_path) if val_path else None,
                       "tokenizer": tokenizer_fingerprint(tokenizer),
                       "settings": asdict(settings)}, sort_keys=True)
    return hashlib.sha256(text.encode()).hexdigest()[:20]


def default_cache_dir() -> str:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "blocktrain", "data")


def text_datasets(path: str, val_path: Optional[str], tokenizer_name: Optional[str],
                  settings: DocSettings, cache_dir: Optional[str], vocab_size: int,
                  preparer: bool, stream: Optional[tuple[int, int, int, int]] = None,
                  vocab_key: str = "model.vocab_size", num_proc: int = 1):
    """(train, validation) windows, prepared here (or by this node's preparer) when not
    cached yet, or when the cached files fail their check (trainer/data/cache_files.py).
    stream: (rank, world, micro-batch, accumulation) of a streamed training corpus
    (trainer/data/stream.py); its validation documents (`val_path`) are prepared as above.
    The training windows carry `identity`: what a checkpoint records of the data. `num_proc`:
    the processes that tokenize (the cache is the same whatever their number)."""
    tokenizer = load_tokenizer(tokenizer_name, settings.kind)
    if len(tokenizer) > vocab_size:
        raise DataError(f"{vocab_key}: the tokenizer {tokenizer_name} has {len(tokenizer)} "
                        f"ids, more than the model's {vocab_size}")
    if stream is not None:
        from trainer.data.stream import StreamWindows

        # Validation is the whole of data.val_path, prepared (and cached) as usual.
        _, val = text_datasets(val_path, val_path, tokenizer_name, settings, cache_dir,
                               vocab_size, preparer, vocab_key=vocab_key, num_proc=num_proc)
        return StreamWindows(path, tokenizer, settings, *stream), val
    root = cache_dir or default_cache_dir()
    key = cache_key(path, val_path, tokenizer, settings)
    folder = os.path.join(root, key)
    fresh = not os.path.exists(os.path.join(folder, "meta.json"))
    meta = _trusted(folder, path, val_path, tokenizer, settings, preparer, vocab_size, num_proc)
    if preparer and not fresh:  # a fresh one said it in its summary line
        log.info("data: %s training windows cached in %s; %s", f"{meta['train']['windows']:,}",
                 folder, fill_line(meta["train"], settings.seq_len))
    train = PackedWindows(os.path.join(folder, "train"))
    files = {"data.path": source_fingerprint(path),
             "data.val_path": source_fingerprint(val_path) if val_path else None}
    train.identity = identity(key, files, tokenizer_name, tokenizer_fingerprint(tokenizer),
                              settings, meta)
    return train, PackedWindows(os.path.join(folder, "val"))


def _trusted(folder: str, path: str, val_path: Optional[str], tokenizer, settings: DocSettings,
             preparer: bool, vocab_size: int, num_proc: int) -> dict:
    """The cached folder's meta once its files pass their check: prepared when missing, and
    prepared again (by the preparer; the others wait for it) when a file fails."""
    damaged = None  # what was wrong with the folder found, once it was discarded
    for attempt in range(3):
        if not os.path.exists(os.path.join(folder, "meta.json")):
            if preparer:
                try:
                    _prepare_locked(folder, path, val_path, tokenizer, settings, num_proc)
                except DataError as exc:  # e.g. a dataset name, the hub out of reach
                    if damaged is None:
                        raise
                    raise DataError(f"data.cache_dir: {damaged}, and preparing it again "
                                    f"failed: {exc}") from None
            else:
                _wait_for(folder)
        with open(os.path.join(folder, "meta.json")) as f:
            meta = json.load(f)
        wrong = problem(folder, meta, vocab_size)
        if wrong is None:
            return meta
        if attempt == 2 or not preparer and attempt == 1:
            raise DataError(f"data.cache_dir: {wrong}; it was prepared again and is still "
                            "wrong: remove the folder, or set data.cache_dir elsewhere")
        if preparer:
            log.warning("data: cached file not trusted (%s): tokenizing again", wrong)
            _discard(folder)
            damaged = wrong
        else:
            _wait_for_change(folder, os.stat(os.path.join(folder, "meta.json")).st_mtime_ns)
    raise AssertionError("unreachable")


def _discard(folder: str) -> None:
    with open(folder + ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        os.remove(os.path.join(folder, "meta.json"))  # what says "whole": first to go
        shutil.rmtree(folder, ignore_errors=True)


def prepared_folder(path: str, val_path: Optional[str], tokenizer_name: Optional[str],
                    settings: DocSettings, cache_dir: Optional[str]) -> Optional[str]:
    """The cache folder these files, tokenizer and settings were prepared into, when they were;
    None when not (or the tokenizer does not load: the run's own checks say why)."""
    try:
        tokenizer = load_tokenizer(tokenizer_name, settings.kind)
        folder = os.path.join(cache_dir or default_cache_dir(),
                              cache_key(path, val_path, tokenizer, settings))
    except (DataError, OSError):
        return None
    return folder if os.path.exists(os.path.join(folder, "meta.json")) else None


def busiest_share(folder: str, seq_len: int) -> float:
    """The largest share of a training window's positions whose target is learned."""
    import numpy as np

    counts = np.load(os.path.join(folder, "train", "counts.npy"), mmap_mode="r")
    return float(counts[:, 0].max()) / seq_len if len(counts) else 1.0


def _wait_for(folder: str, poll_s: float = 0.5) -> None:
    while not os.path.exists(os.path.join(folder, "meta.json")):
        time.sleep(poll_s)


def _wait_for_change(folder: str, mtime_ns: int, poll_s: float = 0.5) -> None:
    meta = os.path.join(folder, "meta.json")
    while not os.path.exists(meta) or os.stat(meta).st_mtime_ns == mtime_ns:
        time.sleep(poll_s)


def _prepare_locked(folder: str, path: str, val_path: Optional[str], tokenizer,
                    settings: DocSettings, num_proc: int) -> None:
    cache_dir = os.path.dirname(folder)
    os.makedirs(cache_dir, exist_ok=True)
    for gone in remove_dead_temps(cache_dir):
        log.info("data: removed %s, left by a writer that is gone", gone)
    with open(folder + ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # another node on this file system may be at it
        if os.path.exists(os.path.join(folder, "meta.json")):
            return
        work = f"{folder}{TEMP_MARK}{os.getpid()}"
        shutil.rmtree(work, ignore_errors=True)
        try:
            with stop_signals(path):
                log.info("data: tokenizing %s in %d process%s into %s", path, num_proc,
                         "es" if num_proc > 1 else "", folder)
                meta = prepare(work, path, val_path, tokenizer, settings, num_proc)
                meta["files"] = describe(work)
                write_json(os.path.join(work, "meta.json"), meta)
                shutil.rmtree(folder, ignore_errors=True)
                os.rename(work, folder)
        except OSError as exc:
            if is_full(exc):
                raise full(cache_dir) from None
            raise
        finally:
            shutil.rmtree(work, ignore_errors=True)
    log.info("data: %s", summary_line(meta, folder))


def write_json(path: str, value) -> None:
    with open(path, "w") as f:
        json.dump(value, f, indent=1)
        f.flush()
        os.fsync(f.fileno())


def summary_line(meta: dict, folder: str) -> str:
    t = meta["train"]
    return (f"{meta['documents']:,} documents tokenized in {meta['tokenize_s']:.1f} s "
            f"({meta['documents'] / max(meta['tokenize_s'], 1e-9):,.0f} docs/s, "
            f"{meta['tokens'] / max(meta['tokenize_s'], 1e-9):,.0f} tokens/s); train: "
            f"{t['windows']:,} windows, {t['supervised']:,} supervised tokens, "
            f"{fill_line(t, meta['settings']['seq_len'])}; {skipped_line(meta)}; cached in "
            f"{folder}")


def fill_line(split: dict, seq_len: int) -> str:
    """How full a split's windows are, and how much of what fills them is learned."""
    real = split["real_tokens"]
    return (f"packing efficiency {real / max(1, split['windows'] * seq_len):.1%} (real tokens "
            f"over window tokens), supervised fraction {split['supervised'] / max(1, real):.1%}"
            " (of the real tokens)")


def skipped_line(meta: dict) -> str:
    """What was left out, in meta.json's own counts and names."""
    why = meta.get("skipped_why", {})
    parts = [f"skipped {meta['skipped']} documents" + (" (" + ", ".join(
        f"{n} {k.replace('_', ' ')}" for k, n in why.items() if n) + ")" if meta["skipped"]
        else "")]
    dropped = {s: meta[s]["dropped_overlong"] for s in ("train", "val")}
    truncated = {s: meta[s]["truncated"] for s in ("train", "val")}
    if any(dropped.values()):
        parts.append(f"dropped_overlong {dropped['train']} train, {dropped['val']} val")
    if any(truncated.values()):
        parts.append(f"truncated {truncated['train']} train, {truncated['val']} val")
    if meta.get("bad_records"):
        parts.append(f"bad_records {meta['bad_records']} (first: "
                     f"{meta['bad_record_examples'][0]})")
    return "; ".join(parts)
