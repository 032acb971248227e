"""A checkpoint's `.metadata`, read without running code, and compared with the model at hand.

DCP writes `.metadata` with pickle, and its reader unpickles it: a crafted file (with its size
and CRC updated in COMMITTED.json) would run whatever it names while a run resumes or a model is
exported. `SafeReader` is DCP's file-system reader with one change: the metadata goes through an
unpickler that admits only the types DCP's metadata is made of, so anything else is refused,
naming the file, before a single byte of it acts.

`shape_mismatches` says which parameters of a checkpoint differ from the model built now, so a
resume after a change of `model.*` settings is one line naming the parameter and the setting.
"""

from __future__ import annotations

import io
import os
import pickle
from typing import Any

import torch
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta, TensorStorageMetadata

# (module, name) -> allowed; what DCP's Metadata pickles to (seen with pickletools on torch 2.11
# and 2.13), and nothing that can run a command.
_ALLOWED = {
    "torch.distributed.checkpoint.metadata": {
        "Metadata", "TensorStorageMetadata", "BytesStorageMetadata", "ChunkStorageMetadata",
        "TensorProperties", "MetadataIndex", "StorageMeta", "_MEM_FORMAT_ENCODING"},
    "torch.distributed.checkpoint.filesystem": {"_StorageInfo"},
    "torch.distributed.checkpoint.planner": {"LoadItemType", "WriteItemType"},
    "torch.serialization": {"_get_layout"},
    "torch": {"Size"},
    "pathlib": {"PosixPath", "PurePosixPath", "WindowsPath", "PureWindowsPath", "Path"},
    "collections": {"OrderedDict"},
    "builtins": {"set", "frozenset", "slice"},
}


class UnsafeMetadata(Exception):
    """The metadata names something DCP's metadata is never made of; the message says which
    file and what."""


class _Unpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        if name in _ALLOWED.get(module, ()):
            return super().find_class(module, name)
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)  # dtypes pickle as torch.<name>
        raise UnsafeMetadata(f"{module}.{name}")


def read_metadata(path: str) -> Metadata:
    """Unpickle a `.metadata` file admitting only DCP's metadata types; raises UnsafeMetadata."""
    with open(path, "rb") as f:
        data = f.read()
    try:
        metadata = _Unpickler(io.BytesIO(data)).load()
    except UnsafeMetadata as exc:
        raise UnsafeMetadata(f"{path} names {exc}, which a checkpoint's metadata never holds; "
                             "refusing to read it (it would run code)") from None
    if not isinstance(metadata, Metadata):
        raise UnsafeMetadata(f"{path} holds a {type(metadata).__name__}, not DCP metadata")
    return metadata


class SafeReader(FileSystemReader):
    """DCP's file-system reader, reading `.metadata` through the restricted unpickler."""

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        metadata = read_metadata(os.path.join(str(self.path), ".metadata"))
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata


def shape_mismatches(metadata: Metadata, model_state: dict[str, Any]) -> list[str]:
    """'name: saved [..], now [..]' for every model tensor whose shape differs, and the
    tensors only one side has."""
    saved = {key[len("model."):]: tuple(item.size)
             for key, item in metadata.state_dict_metadata.items()
             if key.startswith("model.") and isinstance(item, TensorStorageMetadata)}
    now = {name: tuple(t.shape) for name, t in model_state.items()
           if isinstance(t, torch.Tensor)}
    out = [f"{name}: saved {list(saved[name])}, now {list(now[name])}"
           for name in sorted(saved.keys() & now.keys()) if saved[name] != now[name]]
    out += [f"{name}: only in the checkpoint" for name in sorted(saved.keys() - now.keys())]
    out += [f"{name}: not in the checkpoint" for name in sorted(now.keys() - saved.keys())]
    return out
