"""Tokenizing documents once, with a progress bar, and packing both splits (the work behind
trainer/data/documents.py's cache)."""

from __future__ import annotations

import contextlib
import gc
import itertools
import logging
import os
import shutil
import sys
import time
from typing import Iterator, Optional

import numpy as np

from trainer.data.chat import ChatError
from trainer.data.chat_batch import chat_batch
from trainer.data.doc_columns import column, docs_in_bins, iter_docs, listed
from trainer.data.formats import FormatError, conversation, record_name
from trainer.data.map_procs import tokenizer_threads_kept
from trainer.data.packing import (best_fit_bins, bin_window, concat_count, concat_windows,
                                  fit_length, write_windows)
from trainer.data.records import BadRecords, checked_files
from trainer.data.sources import (DataError, DocSettings, check_fields, data_files,
                                  is_saved_dataset, open_documents)

log = logging.getLogger("trainer")
BATCH = 256  # records per tokenizer call: amortises the call, bounds a worker's memory
SPLIT_SEED = 0  # which documents are held out for validation: fixed, so train.seed can change


class _Progress:
    """Rank 0's bar while tokenizing: documents, tokens/s, time left."""

    def __init__(self, total: Optional[int]) -> None:
        from tqdm import tqdm

        self.bar = tqdm(total=total, unit="doc", desc="tokenizing", dynamic_ncols=True,
                        disable=None, file=sys.stderr, leave=False)
        self.tokens, self.started = 0, time.perf_counter()

    def update(self, docs: int, tokens: int) -> None:
        self.tokens += tokens
        rate = self.tokens / max(time.perf_counter() - self.started, 1e-9)
        self.bar.set_postfix(tok_s=f"{rate:,.0f}", refresh=False)
        self.bar.update(docs)

    def close(self) -> None:
        self.bar.close()


def _text_batch(tokenizer, settings: DocSettings, eos: int, path: str):
    def encode(batch: dict, indices: list[int]) -> dict:
        texts = batch[settings.text_field]
        ids, sup, bad = [[] for _ in texts], [[] for _ in texts], [[] for _ in texts]
        good = []
        for n, (index, text) in enumerate(zip(indices, texts)):
            if isinstance(text, str):
                good.append(n)
                continue
            where = record_name(path, index, {"id": batch["id"][n]} if "id" in batch else {})
            why = (f"data.text_field: {settings.text_field!r} of {where} is "
                   f"{'null' if text is None else f'{type(text).__name__} {text!r}'}, not text")
            if not settings.skip_bad_records:
                raise DataError(f"{why}; fix the record, or set data.skip_bad_records=true to "
                                "skip such records (counted)")
            bad[n] = [where, f"{settings.text_field!r} is not text"]
        encoded = tokenizer([texts[n] for n in good])["input_ids"] if good else []
        for n, row in zip(good, encoded):
            ids[n] = list(row) + [eos]
            sup[n] = [True] * len(ids[n])
        return {"ids": ids, "sup": sup, "bad": bad}
    return encode


def _chat_batch(tokenizer, settings: DocSettings, path: str):
    def encode(batch: dict, indices: list[int]) -> dict:
        records = [dict(zip(batch, values)) for values in zip(*batch.values())]
        wheres = [record_name(path, index, record) for index, record in zip(indices, records)]
        results: list = [None] * len(records)
        shaped = []  # (position, messages) of the records in a known shape
        for n, (record, where) in enumerate(zip(records, wheres)):
            try:
                shaped.append((n, conversation(record, settings.format, settings.messages_field,
                                               settings.prompt_field, settings.completion_field,
                                               where)))
            except FormatError as exc:
                results[n] = exc
        done = chat_batch(tokenizer, [m for _, m in shaped], settings.train_on,
                          [wheres[n] for n, _ in shaped])
        for (n, _), result in zip(shaped, done):
            results[n] = result
        ids, sup, bad = [], [], []
        for where, result in zip(wheres, results):
            problem = None if isinstance(result, tuple) else _problem(result, where, settings)
            ids.append([] if problem else result[0])
            sup.append([] if problem else result[1])
            bad.append([where, problem] if problem else [])
        return {"ids": ids, "sup": sup, "bad": bad}
    return encode


def _problem(exc: Exception, where: str, settings: DocSettings) -> str:
    """Why a record is left out (data.skip_bad_records), else the DataError naming it."""
    if isinstance(exc, (ChatError, FormatError)):
        if not settings.skip_bad_records:
            raise DataError(str(exc)) from None
        return str(exc)
    why = f"{type(exc).__name__}: {(str(exc).splitlines() or [''])[0][:200]}"
    if not settings.skip_bad_records:  # the template itself raised (jinja2, raise_exception)
        raise DataError(f"data.tokenizer: its chat template fails on {where} ({why}); fix the "
                        "record, or set data.skip_bad_records=true to skip such records "
                        "(counted)") from None
    return why


def tokenize(records, tokenizer, settings: DocSettings, progress: Optional[_Progress],
             path: str, num_proc: int = 1, arrow: Optional[str] = None):
    """The records as documents: `ids`, `sup` (supervised per token), `length`, `usable` (worth
    a window) and `bad` ([where, why] of a bad record skipped with data.skip_bad_records, which
    comes out empty) columns; `path` names a bad record's source. With `num_proc` > 1,
    `datasets` runs the batches in that many processes (its own progress bar then) and joins
    their outputs in the records' order, so the result is the same whatever `num_proc`.
    `arrow`: the file the documents are written to (a worker's share: with a suffix), and where
    what `datasets` derives from them (select) goes too; else beside the records, in its own
    cache."""
    eos = tokenizer.eos_token_id if tokenizer.eos_token_id is not None else 0
    encode = (_text_batch(tokenizer, settings, eos, path) if settings.kind == "text"
              else _chat_batch(tokenizer, settings, path))
    procs = max(1, min(num_proc, -(-len(records) // BATCH)))

    def encode_and_count(batch: dict, indices: list[int]) -> dict:
        with _collector_paused():
            out = encode(batch, indices)
        out["length"] = [len(x) for x in out["ids"]]
        pairs = zip(out["ids"], out["sup"])
        out["usable"] = [_is_usable(ids, sup, settings.kind) for ids, sup in pairs]
        if progress is not None:
            progress.update(len(out["ids"]), sum(out["length"]))
        return out

    with tokenizer_threads_kept():  # `datasets` leaves them at one
        return records.map(encode_and_count, batched=True, batch_size=BATCH, with_indices=True,
                           remove_columns=records.column_names, load_from_cache_file=False,
                           keep_in_memory=False, num_proc=procs if procs > 1 else None,
                           desc="tokenizing", new_fingerprint=_fingerprint(records, settings),
                           cache_file_name=arrow)


@contextlib.contextmanager
def _collector_paused() -> Iterator[None]:
    """Python's cycle collector off while a batch is encoded. A batch makes some 10^5 small
    objects (offsets, masks) that all live until it returns; each collection the allocations
    set off walked them and the rest of the heap for nothing: 28% of the main thread's time
    (8,000 ChatML conversations, 2026-12-05). What a batch leaves in cycles is collected after."""
    was = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was:
            gc.enable()


def _is_usable(ids: list, sup: list, kind: str) -> bool:
    """Worth a window: two tokens or more, and (chat) some token after the first to learn."""
    return len(ids) >= 2 and (kind != "chat" or any(itertools.islice(sup, 1, None)))


def _fingerprint(records, settings: DocSettings) -> str:
    """The output's name in `datasets`' cache, given here: by default `datasets` hashes the
    function with its tokenizer, which takes seconds (and its cache is not read again:
    load_from_cache_file=False). Unique per call, so no two preparations share files."""
    import hashlib

    text = f"{records._fingerprint}{settings}{os.getpid()}{time.time_ns()}"
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def _usable(docs, bad_here: int):
    """The documents worth a window (`usable`, found while tokenizing), and why the others are
    not (`bad_here`: this split's skipped bad records, which come out empty)."""
    usable = column(docs, "usable")
    kept = docs.remove_columns("usable").select(np.flatnonzero(usable))
    short = int((column(docs, "length") < 2).sum()) - bad_here
    return kept, {"under_two_tokens": short, "bad_records": bad_here,
                  "no_assistant_turn": len(docs) - len(kept) - short - bad_here}


def _nothing_usable(where: str, key: str, split: str, total: int, why: dict,
                    settings: DocSettings) -> DataError:
    if settings.kind == "chat" and total and why["no_assistant_turn"] == total:
        return DataError(f"{key}: none of the {total} records in {where} has an assistant turn "
                         f"to learn (data.train_on={settings.train_on}): a record needs a turn "
                         "whose role is assistant (ShareGPT: from gpt; Alpaca: output)")
    reasons = ", ".join(f"{n} {k.replace('_', ' ')}" for k, n in why.items() if n)
    return DataError(f"{key}: no usable {split} documents in {where} ({total} records"
                     + (f": {reasons}" if reasons else "") + "; each needs two tokens or more"
                     + (", and an assistant turn" if settings.kind == "chat" else "") + ")")


def _tokenized_split(where: str, key: str, tokenizer, settings: DocSettings, clean: str,
                     bad: BadRecords, num_proc: int, arrow: str):
    """One split's records, checked (trainer/data/records.py) and tokenized into `arrow`, and
    how many of them were bad records skipped (they come out empty; bad lines never became
    records)."""
    files = None if is_saved_dataset(where) else data_files(where)
    if files:
        files = checked_files(files, key, settings.skip_bad_records, clean, bad)
    records = open_documents(where, settings.split, files=files, key=key)
    check_fields(list(records.column_names or []), settings, where)
    # Our bar (documents, tokens/s) lives in this process; workers report to `datasets`' own.
    progress = _Progress(len(records)) if num_proc <= 1 else None
    try:
        with _datasets_bar(progress is None):
            docs = tokenize(records, tokenizer, settings, progress, where, num_proc, arrow)
    except UnicodeDecodeError as exc:
        raise DataError(f"{key}: {where} is not UTF-8 text ({exc.reason} at byte "
                        f"{exc.start})") from None
    finally:
        if progress is not None:
            progress.close()
    skipped = [b for b in listed(docs, "bad") if b]
    for where_, why in skipped:
        bad.add(where_, why)
    return docs.remove_columns("bad"), len(skipped)


@contextlib.contextmanager
def _datasets_bar(shown: bool):
    """`datasets`' progress bar for the one map call that has no bar of ours."""
    import datasets

    if shown:
        datasets.enable_progress_bars()
    try:
        yield
    finally:
        datasets.disable_progress_bars()


def prepare(work: str, path: str, val_path: Optional[str], tokenizer,
            settings: DocSettings, num_proc: int = 1) -> dict:
    """Tokenize (in `num_proc` processes), hold out validation documents (unless `val_path`),
    pack; returns the stats."""
    import datasets

    datasets.disable_progress_bars()  # ours says documents and tokens/s
    started = time.perf_counter()
    places = {"train": (path, "data.path")}
    if val_path:
        places["val"] = (val_path, "data.val_path")
    docs, raw, why, bad = {}, 0, {}, BadRecords()
    clean = os.path.join(work, "clean")  # good lines of jsonl files with bad ones, if skipping
    # The tokenized documents (and what `datasets` derives from them) until packed: here, not
    # in `datasets`' own cache, where each preparation left a copy of the data for good.
    arrows = os.path.join(work, "arrow")
    os.makedirs(arrows, exist_ok=True)
    for split, (where, key) in places.items():
        tokenized, bad_here = _tokenized_split(where, key, tokenizer, settings, clean, bad,
                                               num_proc, os.path.join(arrows, f"{split}.arrow"))
        raw += len(tokenized)
        docs[split], why[split] = _usable(tokenized, bad_here)
        if len(docs[split]) == 0:
            raise _nothing_usable(where, key, split, len(tokenized), why[split], settings)
    if "val" not in docs:
        docs["train"], docs["val"] = _hold_out(docs["train"], settings.val_fraction)
    tokenize_s = time.perf_counter() - started
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else (
        tokenizer.eos_token_id or 0)
    meta = {"documents": raw, "skipped": raw - len(docs["train"]) - len(docs["val"]),
            "skipped_why": {k: sum(w[k] for w in why.values()) for k in why["train"]},
            "bad_records": bad.count, "bad_record_examples": bad.examples,
            "tokens": int(column(docs["train"], "length").sum()
                          + column(docs["val"], "length").sum()),
            "tokenize_s": tokenize_s, "settings": settings.__dict__}
    for split in ("train", "val"):
        meta[split] = pack_split(os.path.join(work, split), docs[split], settings.seq_len, pad,
                                 settings, places.get(split, places["train"])[1])
    del docs, tokenized  # memory-mapped from `arrows`
    shutil.rmtree(clean, ignore_errors=True)
    shutil.rmtree(arrows, ignore_errors=True)
    meta["seconds"] = time.perf_counter() - started
    return meta


def _hold_out(docs, fraction: float):
    """(train, val): a fixed, seeded choice of documents for validation, at least one."""
    n = len(docs)
    if n < 2:
        raise DataError(f"data.path: {n} usable document; a validation split needs another "
                        "(or set data.val_path)")
    n_val = min(n - 1, max(1, round(n * fraction)))
    held = np.sort(np.random.default_rng(SPLIT_SEED).permutation(n)[:n_val])
    keep = np.setdiff1d(np.arange(n), held)
    return docs.select(keep), docs.select(held)


def pack_split(folder: str, docs, seq_len: int, pad_id: int, settings: DocSettings,
               key: str = "data.path") -> dict:
    """Pack one split's tokenized documents (columns ids, sup) into `folder` (`key`: the
    setting that names where they came from)."""
    lengths = column(docs, "length").astype(np.int64) - 1  # training positions per doc
    if settings.kind == "text" and settings.packing:
        num = concat_count(lengths + 1, seq_len)
        windows = concat_windows(iter_docs(docs), seq_len, pad_id)
        truncated = dropped = 0
    else:
        kept = [fit_length(int(n), seq_len, settings.overlong) for n in lengths]
        truncated = sum(1 for n, k in zip(lengths, kept) if 0 < k < n)
        dropped = sum(1 for n, k in zip(lengths, kept) if k == 0 and n > 0)
        bins = (best_fit_bins(kept, seq_len) if settings.packing
                else [[i] for i, k in enumerate(kept) if k > 0])
        num = len(bins)
        windows = (bin_window(parts, seq_len, pad_id) for parts in docs_in_bins(docs, bins))
    split = os.path.basename(folder)
    if num == 0:
        raise DataError(f"data.overlong: all {dropped} {split} documents of {key} are longer "
                        f"than data.seq_len={seq_len} and data.overlong=drop drops them; raise "
                        "data.seq_len or set data.overlong=truncate")
    write_windows(folder, windows, num, seq_len, os.path.dirname(os.path.dirname(folder)))
    counts = np.load(os.path.join(folder, "counts.npy"))
    supervised, real = int(counts[:, 0].sum()), int(counts[:, 1].sum())
    top = max(int(np.load(os.path.join(folder, f"{name}.npy"), mmap_mode="r").max())
              for name in ("inputs", "targets"))
    # efficiency: real tokens over the windows' capacity; supervised_fraction: of the real.
    return {"windows": num, "supervised": supervised, "real_tokens": real,
            "efficiency": real / max(1, num * seq_len),
            "supervised_fraction": supervised / max(1, real), "truncated": int(truncated),
            "dropped_overlong": int(dropped), "max_id": top}

