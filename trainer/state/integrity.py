"""Whether a checkpoint folder can be trusted, and reading its small files safely.

COMMITTED.json lists every file with its size and CRC-32; a folder without it is torn, one whose
files do not match it is damaged. Matching its checksums is not enough for the two files read
as data, which a tool or a hand may have written wrongly before the checksums were made:
`state.json` must be a JSON object, and each `rng/rank<r>.pt` plain tensors (read with
`weights_only`: anything else would be an object to build, which is never done). A folder
failing any of this is skipped like any other damage (trainer/state/checkpoint.py).
"""

from __future__ import annotations

import json
import os
import re
import warnings
import zipfile
import zlib
from typing import Any, Optional

import torch

COMMIT = "COMMITTED.json"
STATE = "state.json"


class Damaged(ValueError):
    """A checkpoint file that cannot be read as what it should be; the message names it."""


def crc32(path: str) -> int:
    crc = 0
    with open(path, "rb") as f:
        while chunk := f.read(8 << 20):
            crc = zlib.crc32(chunk, crc)
    return crc


def manifest(folder: str, names: list[str]) -> dict[str, list[int]]:
    return {name: [os.path.getsize(os.path.join(folder, name)),
                   crc32(os.path.join(folder, name))] for name in names}


def read_state(folder: str) -> dict[str, Any]:
    """state.json as a dict, or Damaged naming the file and what is wrong."""
    path = os.path.join(folder, STATE)
    try:
        with open(path) as f:
            state = json.load(f)
    except (OSError, UnicodeDecodeError, ValueError) as error:
        raise Damaged(f"{STATE} cannot be read as JSON ({error})") from None
    if not isinstance(state, dict):
        raise Damaged(f"{STATE} holds a JSON {type(state).__name__}, not an object")
    return state


def read_rng(folder: str, name: str) -> dict[str, torch.Tensor]:
    """rng/rank<r>.pt: generator states as plain tensors, or Damaged naming the file."""
    path = os.path.join(folder, name)
    if not zipfile.is_zipfile(path):  # torch.save writes a zip; a bare pickle is not ours
        raise Damaged(f"{name} {_why_unreadable(None, path)}")
    try:
        with warnings.catch_warnings():  # its warnings, too, would suggest weights_only=False
            warnings.simplefilter("ignore")
            state = torch.load(path, weights_only=True)
    except Exception as error:  # torch's UnpicklingError, a zip error, a truncated file
        raise Damaged(f"{name} {_why_unreadable(error, path)}") from None
    if not (isinstance(state, dict) and all(torch.is_tensor(v) for v in state.values())):
        raise Damaged(f"{name} holds {type(state).__name__}, not generator states")
    return state


def _why_unreadable(error: Optional[Exception], path: str) -> str:
    # torch's own message ends in advice to load with weights_only=False, i.e. to run whatever
    # the file names: only what it names is kept.
    named = re.search(r"GLOBAL ([\w.]+)", str(error or ""))
    name = named.group(1) if named else _first_global(path)
    if name:
        return (f"names {name}, which generator states never hold; it is not loaded (it would "
                "run code)")
    return ("is not a file torch.save wrote" if error is None
            else f"cannot be read ({type(error).__name__})")


def _first_global(path: str) -> Optional[str]:
    """The first module.name a plain pickle file refers to, read without unpickling (torch's
    reader stops at opcodes of newer pickle protocols before it reaches the name)."""
    import pickletools

    strings: list[str] = []
    try:
        with open(path, "rb") as f:
            for opcode, arg, _ in pickletools.genops(f):
                if opcode.name == "GLOBAL":
                    return str(arg).replace(" ", ".")
                if opcode.name == "STACK_GLOBAL" and len(strings) >= 2:
                    return f"{strings[-2]}.{strings[-1]}"
                if isinstance(arg, str):
                    strings.append(arg)
    except Exception:  # not a pickle, or a damaged one: nothing to name
        return None
    return None


def verify(folder: str) -> Optional[str]:
    """None if `folder` is a complete, intact checkpoint; else why not (one line)."""
    marker = os.path.join(folder, COMMIT)
    if not os.path.exists(marker):
        return f"no {COMMIT} (the save did not finish)"
    try:
        with open(marker) as f:
            files = json.load(f)["files"]
    except (OSError, ValueError, KeyError) as error:
        return f"unreadable {COMMIT}: {error}"
    for name, (size, crc) in sorted(files.items()):
        path = os.path.join(folder, name)
        if not os.path.exists(path):
            return f"{name} is missing"
        if os.path.getsize(path) != size:
            return f"{name} has {os.path.getsize(path)} bytes, {size} were written"
        if crc32(path) != crc:
            return f"{name} does not match its checksum"
    try:
        read_state(folder)
        for name in sorted(n for n in files if n.startswith("rng/")):
            read_rng(folder, name)
    except Damaged as error:
        return str(error)
    return None
