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

from trainer.data.packing import PackedWindows
from trainer.data.sources import (DataError, DocSettings, data_files, is_saved_dataset,
                                  load_tokenizer)
from trainer.data.tokenize_docs import prepare

log = logging.getLogger("trainer")
VERSION = 1  # of the cached folder's layout: a change here makes every key new


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
                  preparer: bool, stream: Optional[tuple[int, int, int, int]] = None):
    """(train, validation) windows, prepared here (or by this node's preparer) when not
    cached yet. stream: (rank, world, micro-batch, accumulation) of a streamed training corpus
    (trainer/data/stream.py); its validation documents (`val_path`) are prepared as above."""
    tokenizer = load_tokenizer(tokenizer_name, settings.kind)
    if len(tokenizer) > vocab_size:
        raise DataError(f"model.vocab_size: the tokenizer {tokenizer_name} has {len(tokenizer)} "
                        f"ids, more than the model's {vocab_size}")
    if stream is not None:
        from trainer.data.stream import StreamWindows

        # Validation is the whole of data.val_path, prepared (and cached) as usual.
        _, val = text_datasets(val_path, val_path, tokenizer_name, settings, cache_dir,
                               vocab_size, preparer)
        return StreamWindows(path, tokenizer, settings, *stream), val
    folder = os.path.join(cache_dir or default_cache_dir(),
                          cache_key(path, val_path, tokenizer, settings))
    if not os.path.exists(os.path.join(folder, "meta.json")):
        if preparer:
            _prepare_locked(folder, path, val_path, tokenizer, settings)
        else:
            _wait_for(folder)
    return PackedWindows(os.path.join(folder, "train")), PackedWindows(os.path.join(folder, "val"))


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


def _prepare_locked(folder: str, path: str, val_path: Optional[str], tokenizer,
                    settings: DocSettings) -> None:
    os.makedirs(os.path.dirname(folder), exist_ok=True)
    with open(folder + ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # another node on this file system may be at it
        if os.path.exists(os.path.join(folder, "meta.json")):
            return
        work = f"{folder}.tmp-{os.getpid()}"
        shutil.rmtree(work, ignore_errors=True)
        try:
            meta = prepare(work, path, val_path, tokenizer, settings)
            with open(os.path.join(work, "meta.json"), "w") as f:
                json.dump(meta, f, indent=1)
            shutil.rmtree(folder, ignore_errors=True)
            os.rename(work, folder)
        finally:
            shutil.rmtree(work, ignore_errors=True)
    log.info("data: %s", summary_line(meta, folder))


def summary_line(meta: dict, folder: str) -> str:
    t = meta["train"]
    return (f"{meta['documents']:,} documents tokenized in {meta['tokenize_s']:.1f} s "
            f"({meta['documents'] / max(meta['tokenize_s'], 1e-9):,.0f} docs/s, "
            f"{meta['tokens'] / max(meta['tokenize_s'], 1e-9):,.0f} tokens/s); train: "
            f"{t['windows']:,} windows, {t['supervised']:,} supervised tokens, packing "
            f"efficiency {t['efficiency']:.1%}; skipped {meta['skipped']}; cached in {folder}")
