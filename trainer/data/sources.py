"""Where documents come from: jsonl or parquet files (a file, a folder searched whole, or a
glob), a dataset saved with `datasets`' save_to_disk, or a dataset name, all read with the
`datasets` library; and the tokenizer that turns them into ids."""

from __future__ import annotations

import glob
import os
from dataclasses import dataclass
from typing import Optional

from trainer.data.chat import ChatError, check_template
from trainer.data.errors import DataError
from trainer.data.formats import FormatError, check_field_names

BUILDERS = {".jsonl": "json", ".json": "json", ".parquet": "parquet"}
SAVED_MARKERS = ("dataset_info.json", "state.json", "dataset_dict.json")

@dataclass(frozen=True)
class DocSettings:
    """Everything that decides the windows, and so the cache key."""
    kind: str  # "text" | "chat"
    seq_len: int
    packing: bool = True
    text_field: str = "text"
    messages_field: str = "messages"
    prompt_field: str = "prompt"
    completion_field: str = "completion"
    train_on: str = "assistant"
    overlong: str = "truncate"
    split: str = "train"
    val_fraction: float = 0.01
    format: str = "auto"  # chat: the record shape (trainer/data/formats.py)
    skip_bad_records: bool = False  # leave out (and count) records that cannot be read


def data_files(path: str) -> list[str]:
    """The jsonl / parquet files `path` names: a file, a folder (searched whole) or a glob."""
    if any(c in path for c in "*?["):
        found = sorted(glob.glob(path, recursive=True))
    elif os.path.isdir(path):
        found = sorted(os.path.join(root, name) for root, _, names in os.walk(path)
                       for name in names)
    else:
        found = [path] if os.path.isfile(path) else []
    files = [f for f in found if os.path.splitext(f)[1] in BUILDERS]
    builders = {BUILDERS[os.path.splitext(f)[1]] for f in files}
    if len(builders) > 1:
        raise DataError(f"data.path: {path} mixes jsonl and parquet files; point it at one kind")
    return files


def is_saved_dataset(path: str) -> bool:
    return os.path.isdir(path) and any(os.path.exists(os.path.join(path, m))
                                       for m in SAVED_MARKERS)


def open_documents(path: str, split: str, streaming: bool = False,
                   files: Optional[list[str]] = None, key: str = "data.path"):
    """A `datasets` Dataset (IterableDataset when streaming) of the records at `path` (read
    from `files` when given: the checked copies trainer/data/records.py makes)."""
    import datasets

    if is_saved_dataset(path):
        loaded = datasets.load_from_disk(path)
        if isinstance(loaded, datasets.DatasetDict):
            if split not in loaded:
                raise DataError(f"data.split: {path} has splits {', '.join(loaded)}, not {split!r}")
            loaded = loaded[split]
        return loaded.to_iterable_dataset() if streaming else loaded
    files = files or data_files(path)
    if files:
        builder = BUILDERS[os.path.splitext(files[0])[1]]
        try:
            return datasets.load_dataset(builder, data_files=files, split="train",
                                         streaming=streaming)
        except Exception as exc:  # pyarrow's and datasets' many types: the files are the cause
            raise DataError(f"{key}: cannot read {path} ({_root_cause(exc)})") from None
    if os.path.exists(path) or path.startswith((".", "/", "~")):
        raise DataError(f"{key}: {path} holds no .jsonl, .json or .parquet file")
    from trainer.data.hub import load_named

    return load_named(path, split, streaming, key)


def _root_cause(exc: BaseException) -> str:
    """The innermost error's first line: `datasets` wraps the parser's in its own."""
    while exc.__cause__ is not None or exc.__context__ is not None:
        exc = exc.__cause__ or exc.__context__
    return f"{type(exc).__name__}: {(str(exc).splitlines() or [''])[0][:200]}"


def load_tokenizer(name: Optional[str], kind: str):
    if not name:
        raise DataError("data.tokenizer: data=text and data=chat need a Hugging Face tokenizer: "
                        "set data.tokenizer=<folder or name> (model=hf uses model.path)")
    from transformers import AutoTokenizer

    offline = None
    if not os.path.exists(name) and not name.startswith((".", "/", "~")):  # a hub name: local
        # cache only when the hub is out of reach (else each request retries for many seconds)
        from trainer.data.hub import offline_reason

        offline = offline_reason()
    try:
        tokenizer = AutoTokenizer.from_pretrained(name)
    except Exception as exc:
        raise DataError(f"data.tokenizer: cannot load a tokenizer from {name} "
                        + (f"({offline}, and it is not in the local cache: " if offline else "(")
                        + f"{str(exc).splitlines()[0][:200]})") from None
    if kind == "chat":
        try:
            check_template(tokenizer, name)
        except ChatError as exc:
            raise DataError(str(exc)) from None
    return tokenizer


def first_record_fields(path: str, split: str,
                        key: str = "data.path") -> Optional[list[str]]:
    """The fields of the first record, read cheaply (one jsonl line, a parquet schema, a saved
    dataset's features); None for a dataset name (the hub is asked only when the run starts).
    Every parquet file's footer is read, so one bad file among good ones is named here."""
    if is_saved_dataset(path):
        return list(open_documents(path, split).column_names)
    files = data_files(path)
    if not files:
        if os.path.exists(path) or path.startswith((".", "/", "~")):
            raise DataError(f"{key}: {path} holds no .jsonl, .json or .parquet file"
                            if os.path.exists(path) else f"{key}: no such file: {path}")
        return None
    first = files[0]
    if first.endswith(".parquet"):
        from trainer.data.records import check_parquet

        for other in files:
            check_parquet(other, key)
        import pyarrow.parquet as pq

        return list(pq.read_schema(first).names)
    return _jsonl_fields(first, key)


def _jsonl_fields(path: str, key: str) -> list[str]:
    import json

    try:
        with open(path, encoding="utf-8") as f:
            line = next((line for line in f if line.strip()), None)
    except UnicodeDecodeError as exc:
        raise DataError(f"{key}: {path} is not UTF-8 text ({exc.reason} at byte "
                        f"{exc.start})") from None
    if line is None:
        raise DataError(f"{key}: {path} is empty")
    try:
        record = json.loads(line)
    except ValueError as exc:
        raise DataError(f"{key}: {path}: the first line is not JSON ({exc})") from None
    if not isinstance(record, dict):
        raise DataError(f"{key}: {path}: a record must be a JSON object")
    return list(record)


def check_fields(names: list[str], settings: DocSettings, path: str) -> None:
    """The field the documents are read from is there; else one line naming those that are."""
    if settings.kind == "text" and settings.text_field not in names:
        raise DataError(f"data.text_field: {path} has no field {settings.text_field!r}; its "
                        f"fields: {', '.join(names)}")
    if settings.kind == "chat":
        try:
            check_field_names(names, settings.format, settings.messages_field,
                              settings.prompt_field, settings.completion_field, path)
        except FormatError as exc:
            raise DataError(str(exc)) from None


def document_settings(d) -> DocSettings:
    """The DocSettings of a DataConfig (data=text / chat)."""
    return DocSettings(d.source, d.seq_len, d.packing, d.text_field, d.messages_field,
                       d.prompt_field, d.completion_field, d.train_on, d.overlong, d.split,
                       d.val_fraction, d.format, d.skip_bad_records)
