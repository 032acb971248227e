"""The disk tier's files: where they go, how bytes get in and out, and cleaning up after crashes.

Kept apart from the store's threads and bookkeeping (offload/disk.py), which only call these.
"""

from __future__ import annotations

import fcntl
import os
import shutil
import socket
import tempfile

import torch
from torch import Tensor

from offload.engine import OffloadError

FOLDER_PREFIX = "blocktrain-offload-"


def check_writable(dir: str, need_bytes: int) -> None:
    """Start-up check: `dir` can be created and written, and has need_bytes free."""
    try:
        os.makedirs(dir, exist_ok=True)
        with tempfile.TemporaryFile(dir=dir):
            pass
    except OSError as error:
        raise OffloadError(f"offload.dir: {dir!r} is not writable ({error})") from error
    free = shutil.disk_usage(dir).free
    if free < need_bytes:
        raise OffloadError(f"offload.dir: {dir!r} has {free} bytes free, {need_bytes} are needed")


def host_tag() -> str:
    """This host, as it appears in folder names (no separators)."""
    return socket.gethostname().replace(os.sep, "_").replace("-", "_")


def hold(folder: str) -> int:
    """Take an exclusive lock on the folder itself for this process's lifetime; returns the
    descriptor. The kernel drops it when the process ends in any way (kill -9 too, and before a
    dead child is reaped, while its pid still answers), so a folder whose lock can be taken is
    stale."""
    fd = os.open(folder, os.O_RDONLY)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:  # a file system without locks: the folder then always looks held
        pass
    return fd


def _held(folder: str) -> bool:
    try:
        fd = os.open(folder, os.O_RDONLY)
    except OSError:  # gone already
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:  # held by a live process (or no locks here: never remove, to be safe)
        return True
    finally:
        os.close(fd)  # also drops a lock just taken
    return False


def cleanup_stale(dir: str) -> list[str]:
    """Remove the folders that crashed runs on this host left in `dir`; returns their paths.

    A folder is named <prefix><host>-<pid>-<token> and holds a lock while its process lives (see
    `hold`). Only this host's folders are looked at: file locks across a shared file system are not
    to be relied on, and another node's live run must not lose its files.
    """
    removed = []
    for name in sorted(os.listdir(dir)):
        parts = name[len(FOLDER_PREFIX):].split("-") if name.startswith(FOLDER_PREFIX) else []
        if len(parts) != 3 or parts[0] != host_tag() or not parts[1].isdigit():
            continue
        path = os.path.join(dir, name)
        if not _held(path):
            shutil.rmtree(path, ignore_errors=True)
            removed.append(path)
    return removed


def write_all(file, data: Tensor) -> None:
    view = memoryview(data.numpy())
    while view:
        view = view[file.write(view):]


def read_into(file, data: Tensor) -> None:
    view = memoryview(data.numpy())
    while view:
        count = file.readinto(view)
        if not count:
            raise OSError("file shorter than what was written")
        view = view[count:]


def map_private(path: str, nbytes: int) -> Tensor:
    """The file's bytes as a copy-on-write mapping, its pages faulted in here (the reader thread).

    Mapping instead of reading into a fresh allocation saves a copy, and, more to the point on
    the CPU, the memory goes back to the system the moment autograd drops the tensor: a heap
    allocation would stay in the allocator's arena and keep resident memory at its high-water
    mark. Deleting the file while it is mapped is fine; the pages live until unmapped.
    """
    restored = torch.from_file(path, shared=False, size=nbytes, dtype=torch.uint8)
    if nbytes:
        restored[::4096].sum()  # one read per page: backward finds them resident
    return restored
