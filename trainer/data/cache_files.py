"""The cached windows' files checked before a run trusts them, room for them reserved before they
are written, and the leftovers of writers that died removed.

A cached folder's meta.json records every file's size and blake2b digest as written
(`describe`). At start `problem` compares them (sizes first: a truncated file is named without
opening it; then the digest: a same-size file with one id changed is caught too) and checks the
largest id against the model's vocabulary. The memory maps are only opened after that, so a
damaged file is never an mmap traceback or an IndexError mid-run.

A full disk under a memory map is SIGBUS, not an error a program can catch: `reserve` allocates
a file's blocks before it is mapped (posix_fallocate), so "no room" is ENOSPC at a known point,
which `CacheFull` turns into one line naming data.cache_dir.
"""

from __future__ import annotations

import errno
import fcntl
import glob
import hashlib
import os
import shutil
from typing import Optional

CHUNK = 8 << 20  # bytes hashed per read: large reads, bounded memory
TEMP_MARK = ".tmp-"  # a folder being written: <key>.tmp-<pid>, renamed to <key> when whole


class CacheFull(OSError):
    """No room left in data.cache_dir; the message names it. Exit status 74, as a full disk
    during a checkpoint save."""


def digest(path: str) -> str:
    h = hashlib.blake2b(digest_size=16)
    with open(path, "rb") as f:
        while True:
            block = f.read(CHUNK)
            if not block:
                return h.hexdigest()
            h.update(block)


def describe(folder: str) -> dict[str, dict]:
    """{relative path: {"bytes", "blake2b"}} of every .npy file under `folder`."""
    out = {}
    for path in sorted(glob.glob(os.path.join(folder, "*", "*.npy"))):
        out[os.path.relpath(path, folder)] = {"bytes": os.path.getsize(path),
                                              "blake2b": digest(path)}
    return out


def problem(folder: str, meta: dict, vocab_size: int) -> Optional[str]:
    """What is wrong with a cached folder ('<file>: <what>'), or None when it can be trusted."""
    files = meta.get("files")
    if not files:
        return f"{os.path.join(folder, 'meta.json')}: records no file sizes and checksums"
    for name, want in files.items():
        path = os.path.join(folder, name)
        if not os.path.isfile(path):
            return f"{path}: missing"
        size = os.path.getsize(path)
        if size != want["bytes"]:
            return f"{path}: {size} bytes, written as {want['bytes']} (truncated or overwritten)"
    for name, want in files.items():
        path = os.path.join(folder, name)
        if digest(path) != want["blake2b"]:
            return f"{path}: its checksum differs from the one written with it (the file changed)"
    wrong = _counts_problem(folder, meta)
    if wrong is not None:
        return wrong
    top = max((meta[s].get("max_id", -1) for s in ("train", "val") if s in meta), default=-1)
    if top >= vocab_size:
        return (f"{folder}: holds token id {top}, not below the model's vocabulary of "
                f"{vocab_size}")
    return None


def _counts_problem(folder: str, meta: dict) -> Optional[str]:
    """meta.json's window and token counts against the files (a checkpoint records them as the
    data's identity, so they must be the files', not only written beside them)."""
    import numpy as np

    for split in ("train", "val"):
        said = meta.get(split)
        path = os.path.join(folder, split, "counts.npy")
        if said is None or not os.path.isfile(path):
            continue
        counts = np.load(path, mmap_mode="r")
        found = {"windows": int(counts.shape[0]), "supervised": int(counts[:, 0].sum()),
                 "real_tokens": int(counts[:, 1].sum())}
        for key, value in found.items():
            if key in said and said[key] != value:
                return (f"{os.path.join(folder, 'meta.json')}: says {said[key]} {split} "
                        f"{key.replace('_', ' ')}, its files hold {value}")
    return None


def reserve(path: str, nbytes: int, cache_dir: str) -> None:
    """Allocate a file's blocks now, so a memory map over it cannot run out of room later."""
    fd = os.open(path, os.O_RDWR)
    try:
        os.posix_fallocate(fd, 0, nbytes)
    except OSError as exc:
        if exc.errno in (errno.ENOSPC, errno.EDQUOT):
            raise full(cache_dir, nbytes) from None
        if exc.errno not in (errno.EOPNOTSUPP, errno.EINVAL):  # no fallocate: room checked below
            raise
        if shutil.disk_usage(os.path.dirname(path)).free < nbytes:
            raise full(cache_dir, nbytes) from None
    finally:
        os.close(fd)


def full(cache_dir: str, nbytes: Optional[int] = None) -> CacheFull:
    need = f" ({nbytes / 2**20:,.1f} MiB more were needed)" if nbytes else ""
    return CacheFull(errno.ENOSPC, f"no space left in {cache_dir} while caching the tokenized "
                     f"data{need}; nothing was kept. Free space there, or set data.cache_dir "
                     "elsewhere, and start again")


def is_full(exc: BaseException) -> bool:
    return isinstance(exc, OSError) and exc.errno in (errno.ENOSPC, errno.EDQUOT)


def remove_dead_temps(cache_dir: str) -> list[str]:
    """Remove `<key>.tmp-<pid>` folders no writer holds any more; returns those removed.

    A writer holds `<key>.lock` (flock) for as long as it writes its temporary folder, so a
    folder whose lock can be taken here is one whose writer died (killed, out of memory, the
    node lost), on this host or another sharing the file system."""
    removed = []
    for work in sorted(glob.glob(os.path.join(cache_dir, f"*{TEMP_MARK}*"))):
        key, _, pid = os.path.basename(work).rpartition(TEMP_MARK)
        if not pid.isdigit():
            continue
        lock_path = os.path.join(cache_dir, key + ".lock")
        try:
            lock = open(lock_path, "a")
        except OSError:
            continue
        with lock:
            try:
                fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError:  # its writer is alive
                continue
            shutil.rmtree(work, ignore_errors=True)
            removed.append(work)
    return removed
