"""Bad records found before `datasets` reads a file, named by file and line.

`datasets`' json reader stops at a malformed line with a parser message that names neither the
file nor the line (and three tracebacks). Each jsonl file is read here first, line by line: a
line that is not a JSON object is one line naming the file and the line, or, with
`data.skip_bad_records=true`, left out (the good lines of that file are copied into the work
folder, which `datasets` then reads) and counted. Every parquet file's footer is read too, so
one corrupt file in a folder of good ones is named before tokenizing starts.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from typing import Optional

from trainer.data.errors import DataError


@dataclass
class BadRecords:
    """Records left out with data.skip_bad_records=true: how many, and the first few named."""
    count: int = 0
    examples: list[str] = field(default_factory=list)

    def add(self, where: str, why: str) -> None:
        self.count += 1
        if len(self.examples) < 5:
            self.examples.append(f"{where}: {why}")


def _line_problem(line: str) -> Optional[str]:
    try:
        record = json.loads(line)
    except ValueError as exc:
        return f"not JSON ({exc})"
    if not isinstance(record, dict):
        return f"a JSON {type(record).__name__}, not an object"
    return None


def checked_jsonl(path: str, key: str, skip: bool, work: str, bad: BadRecords) -> str:
    """`path`, or (with skip and bad lines in it) a copy of its good lines under `work`."""
    problems: list[tuple[int, str]] = []
    try:
        with open(path, encoding="utf-8") as f:
            for number, line in enumerate(f, start=1):
                if line.strip():
                    why = _line_problem(line)
                    if why is not None:
                        if not skip:
                            raise DataError(
                                f"{key}: {path} line {number} is {why}; fix or remove it, or "
                                "set data.skip_bad_records=true to skip bad records (counted)")
                        problems.append((number, why))
    except UnicodeDecodeError as exc:
        raise DataError(f"{key}: {path} is not UTF-8 text ({exc.reason} at byte "
                        f"{exc.start})") from None
    if not problems:
        return path
    for number, why in problems:
        bad.add(f"{path} line {number}", why)
    os.makedirs(work, exist_ok=True)
    clean = os.path.join(work, f"{len(os.listdir(work)):05d}-{os.path.basename(path)}")
    skipped = {number for number, _ in problems}
    with open(path, encoding="utf-8") as src, open(clean, "w", encoding="utf-8") as dst:
        for number, line in enumerate(src, start=1):
            if number not in skipped:
                dst.write(line)
    return clean


def check_parquet(path: str, key: str) -> None:
    """The file's footer (schema, row groups) reads; else one line naming it."""
    try:
        import pyarrow.parquet as pq

        pq.read_metadata(path)
    except Exception as exc:  # pyarrow raises ArrowInvalid, OSError, ... for a bad file
        raise DataError(f"{key}: {path} is not a readable parquet file "
                        f"({str(exc).splitlines()[0][:200]})") from None


def checked_files(files: list[str], key: str, skip: bool, work: str,
                  bad: BadRecords) -> list[str]:
    """The files `datasets` should read: each checked, jsonl ones cleaned when skipping."""
    out = []
    for path in files:
        if path.endswith(".parquet"):
            check_parquet(path, key)
            out.append(path)
        elif path.endswith(".jsonl"):
            out.append(checked_jsonl(path, key, skip, work, bad))
        else:
            out.append(path)
    return out
