"""What data a run was trained on, and what changed since: the check a resume makes.

A checkpoint records the identity of its training windows (`identity`): the cache key and what
it is made of (the files behind data.path and data.val_path by name, size and modification time,
the tokenizer, the settings), the window counts, and the windows' own checksums. On resume the
windows are the same when their checksums are (touching a file changes nothing); otherwise
`change` says what differs in one phrase ("data.path grew: 299 -> 372 windows (chat.jsonl:
51,234 -> 70,003 bytes)"), and the run refuses it or, with `data.on_change=new_epoch`, starts a
new epoch order of the new windows from the step it resumes at (trainer/data/batches.py).
"""

from __future__ import annotations

import hashlib
import os
from dataclasses import asdict
from typing import Optional

ON_CHANGE = ("refuse", "new_epoch")


def identity(key: str, files: dict, tokenizer_name: Optional[str], tokenizer_hash: str,
             settings, meta: dict) -> dict:
    """`files`: {"data.path": fingerprint, "data.val_path": fingerprint or None} (documents.py's
    source_fingerprint); meta: the cached folder's meta.json."""
    train_files = sorted(k for k in meta.get("files", {}) if k.startswith("train" + os.sep))
    content = hashlib.blake2b("".join(meta["files"][k]["blake2b"] for k in train_files).encode(),
                              digest_size=16).hexdigest()
    return {"key": key, "content": content,
            "windows": {"train": meta["train"]["windows"], "val": meta["val"]["windows"]},
            "files": files, "tokenizer": tokenizer_name, "tokenizer_hash": tokenizer_hash[:16],
            "settings": asdict(settings)}


def _file_changes(saved: Optional[list], now: Optional[list]) -> list[str]:
    def by_name(entries):
        return {e[0]: e for e in entries or [] if isinstance(e, list) and len(e) == 3}

    old, new = by_name(saved), by_name(now)
    out = [f"{os.path.basename(n)}: {old[n][1]:,} -> {new[n][1]:,} bytes"
           for n in sorted(old.keys() & new.keys()) if old[n][1] != new[n][1]]
    out += [f"{os.path.basename(n)} added" for n in sorted(new.keys() - old.keys())]
    out += [f"{os.path.basename(n)} removed" for n in sorted(old.keys() - new.keys())]
    if not out:
        out = [f"{os.path.basename(n)} modified" for n in sorted(old.keys() & new.keys())
               if old[n][2] != new[n][2]]
    return out


def change(saved: dict, now: dict) -> Optional[str]:
    """None when the training windows are the same; else what changed, in one phrase."""
    if saved.get("content") == now.get("content"):
        return None
    before, after = saved["windows"]["train"], now["windows"]["train"]
    verb = "grew" if after > before else "shrank" if after < before else "changed"
    causes, subject = [], "the data"
    for key in ("data.val_path", "data.path"):
        files = _file_changes(saved["files"].get(key), now["files"].get(key))
        causes, subject = files + causes, key if files else subject
    if saved.get("tokenizer_hash") != now.get("tokenizer_hash"):
        causes.append(f"the tokenizer {saved.get('tokenizer')} -> {now.get('tokenizer')}")
    settings = sorted(k for k in saved["settings"].keys() | now["settings"].keys()
                      if saved["settings"].get(k) != now["settings"].get(k))
    causes += [f"data.{k}: {saved['settings'].get(k)!r} -> {now['settings'].get(k)!r}"
               for k in settings]
    return (f"{subject} {verb}: {before} -> {after} training windows"
            + (f" ({'; '.join(causes)})" if causes else " (other tokens)"))


def continue_order(saved: Optional[dict], now: Optional[dict], on_change: str,
                   batch_index: int, step: int) -> tuple[int, Optional[str]]:
    """(the batch index the window order starts at, a note of a change gone on with) for a
    resume at `batch_index`; ConfigError naming data.on_change for a change refused. `saved`:
    the checkpoint's record ({"identity", "origin"}), None from a run that recorded none."""
    from trainer.config import ConfigError

    if not saved or now is None or not saved.get("identity"):
        return (saved or {}).get("origin", 0), None
    what = change(saved["identity"], now)
    if what is None:
        return saved.get("origin", 0), None
    if on_change != "new_epoch":
        raise ConfigError("data.on_change", f"the data differs from what the checkpoint of "
                          f"step {step} was trained on: {what}; resume with the data it was "
                          "trained on, or set data.on_change=new_epoch to go on with a new "
                          f"window order of this data from step {step}")
    return batch_index, (f"data changed since the checkpoint of step {step}: {what}; "
                         f"data.on_change=new_epoch: a new window order of this data starts at "
                         f"step {step}")
