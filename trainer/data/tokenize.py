"""Turn text files into the flat token files that data.source=tokens trains on.

    python -m trainer.tokenize INPUT [INPUT ...] --out DIR [--tokenizer tokenizer.json]

Writes DIR/train.bin and DIR/val.bin (little-endian uint16, or uint32 for vocabularies
over 65536 ids; the layout nanoGPT and Megatron use) and DIR/meta.json. Each file is
one document; a document goes wholly to train or val, decided by the crc32 of its
relative path, so reruns and added files never move an existing document.
"""

from __future__ import annotations

import argparse
import fnmatch
import json
import os
import sys
import zlib
from collections.abc import Iterator
from typing import Protocol

import numpy as np

BYTE_VOCAB_SIZE = 256
UINT16_MAX_VOCAB = 1 << 16
# Large enough to amortise per-call overhead, small enough to bound memory per document.
DEFAULT_CHUNK_BYTES = 8 << 20
SPLITS = ("train", "val")


class UserError(Exception):
    """A problem with the command's input, reported as one line without a traceback."""


class Encoder(Protocol):
    vocab_size: int
    name: str

    def encode(self, chunk: bytes) -> np.ndarray: ...


class ByteEncoder:
    """Every byte is its own token."""

    vocab_size = BYTE_VOCAB_SIZE
    name = "bytes"

    def encode(self, chunk: bytes) -> np.ndarray:
        return np.frombuffer(chunk, dtype=np.uint8)


class HFEncoder:
    """A Hugging Face tokenizer.json, via the optional `tokenizers` package."""

    def __init__(self, path: str) -> None:
        try:
            from tokenizers import Tokenizer  # optional dependency, needed only here
        except ImportError as error:
            raise UserError("--tokenizer needs the tokenizers package: pip install tokenizers") from error
        if not os.path.isfile(path):
            raise UserError(f"--tokenizer: no such file: {path}")
        try:
            self._tokenizer = Tokenizer.from_file(path)
        except Exception as error:  # the Rust binding raises a bare Exception on bad files
            raise UserError(f"--tokenizer: cannot load {path}: {error}") from error
        # Added tokens may sit above the base vocabulary, so size by the largest id.
        vocab = self._tokenizer.get_vocab(with_added_tokens=True)
        self.vocab_size = max(self._tokenizer.get_vocab_size(with_added_tokens=True),
                              max(vocab.values(), default=-1) + 1)
        self.name = os.path.abspath(path)

    def encode(self, chunk: bytes) -> np.ndarray:
        # Replacing undecodable bytes keeps one stray byte from aborting a large corpus.
        text = chunk.decode("utf-8", errors="replace")
        # Special tokens (BOS/EOS templates) are not added per chunk: chunks are not
        # documents, and document boundaries are marked with --eos-id instead.
        ids = self._tokenizer.encode(text, add_special_tokens=False).ids
        return np.asarray(ids, dtype=np.int64)


def token_dtype(vocab_size: int) -> str:
    return "uint16" if vocab_size <= UINT16_MAX_VOCAB else "uint32"


def collect_documents(inputs: list[str], pattern: str) -> list[tuple[str, str]]:
    """(path, relative path) of every document: named files as given, directories walked.

    Files inside directories must match `pattern` (on the file name); hidden
    directories are skipped so .git or .venv never leak into a corpus. The relative
    path (to the named directory, or the bare name for a named file) seeds the split.
    """
    documents: list[tuple[str, str]] = []
    seen: set[str] = set()

    def add(path: str, rel: str) -> None:
        real = os.path.realpath(path)
        if real not in seen:
            seen.add(real)
            documents.append((path, rel))

    for item in inputs:
        if os.path.isfile(item):
            add(item, os.path.basename(item))
        elif os.path.isdir(item):
            found = []
            for dirpath, dirnames, filenames in os.walk(item):
                dirnames[:] = [name for name in dirnames if not name.startswith(".")]
                for name in filenames:
                    if fnmatch.fnmatch(name, pattern):
                        path = os.path.join(dirpath, name)
                        found.append((os.path.relpath(path, item).replace(os.sep, "/"), path))
            for rel, path in sorted(found):
                add(path, rel)
        else:
            raise UserError(f"no such file or directory: {item}")
    if not documents:
        raise UserError(f"no input files found (directories are searched for --glob {pattern!r})")
    return documents


def assign_splits(relpaths: list[str], val_fraction: float) -> list[str]:
    """'train' or 'val' per document, from crc32(relpath) scaled to [0, 1)."""
    scores = [zlib.crc32(rel.encode("utf-8")) / 2**32 for rel in relpaths]
    splits = ["val" if score < val_fraction else "train" for score in scores]
    if val_fraction <= 0:
        return splits
    if len(relpaths) < 2:
        raise UserError("a train/val split needs at least 2 input files (each file is one "
                        "document); split the text into files or pass --val-fraction 0")
    # With few documents the hash can leave a split empty; move the nearest document
    # across, still chosen by hash alone so the outcome stays deterministic.
    if "val" not in splits:
        splits[scores.index(min(scores))] = "val"
    if "train" not in splits:
        splits[scores.index(max(scores))] = "train"
    return splits


def _character_start(data: bytes) -> int:
    """Index at which to cut data so no UTF-8 character is split (0 if none is safe)."""
    cut = len(data)
    if cut and data[cut - 1] >= 0x80:
        # Back off over continuation bytes (0b10xxxxxx) and the lead byte before them;
        # the last character then travels whole with the next piece.
        while cut > 0 and (data[cut - 1] & 0xC0) == 0x80:
            cut -= 1
        if cut > 0 and data[cut - 1] >= 0xC0:
            cut -= 1
    return cut


def read_chunks(path: str, chunk_bytes: int) -> Iterator[bytes]:
    """The file's bytes in pieces of about chunk_bytes, cut where tokenisation is unaffected.

    Pieces end after a newline, which keeps UTF-8 characters and nearly all
    tokenizer merges whole. A line longer than 4 * chunk_bytes is cut before a
    space, or failing that at a character start, so memory stays bounded.
    """
    longest_piece = 4 * chunk_bytes
    carry = b""
    with open(path, "rb") as handle:
        while True:
            block = handle.read(chunk_bytes)
            if not block:
                break
            data = carry + block
            cut = data.rfind(b"\n") + 1
            if cut == 0 and len(data) >= longest_piece:
                cut = data.rfind(b" ")
                if cut <= 0:
                    # Invalid UTF-8 can leave no safe cut; progress matters more then.
                    cut = _character_start(data) or len(data)
            carry = data[cut:]
            if cut:
                yield data[:cut]
    if carry:
        yield carry


def tokenize_files(inputs: list[str], out_dir: str, encoder: Encoder, val_fraction: float,
                   eos_id: int | None, pattern: str, chunk_bytes: int) -> dict:
    """Tokenise every document into out_dir/{train,val}.bin and write meta.json; returns meta."""
    if not 0.0 <= val_fraction < 1.0:
        raise UserError(f"--val-fraction must be in [0, 1), got {val_fraction}")
    if eos_id is not None and not 0 <= eos_id < encoder.vocab_size:
        raise UserError(f"--eos-id {eos_id} is outside the vocabulary [0, {encoder.vocab_size})")
    if os.path.exists(out_dir) and not os.path.isdir(out_dir):
        raise UserError(f"--out {out_dir} exists and is not a directory")
    documents = collect_documents(inputs, pattern)
    splits = assign_splits([rel for _, rel in documents], val_fraction)
    dtype = np.dtype(token_dtype(encoder.vocab_size)).newbyteorder("<")
    os.makedirs(out_dir, exist_ok=True)

    # Write to temporary names and rename at the end so a failed run never leaves a
    # half-written train.bin that looks valid.
    temp_paths = {split: os.path.join(out_dir, f"{split}.bin.partial") for split in SPLITS}
    counts = {split: 0 for split in SPLITS}
    documents_per_split = {split: 0 for split in SPLITS}
    max_ids = {split: -1 for split in SPLITS}
    eos = None if eos_id is None else np.asarray([eos_id], dtype=dtype)
    handles = {split: open(temp_paths[split], "wb") for split in SPLITS}
    try:
        for (path, _), split in zip(documents, splits):
            for chunk in read_chunks(path, chunk_bytes):
                ids = encoder.encode(chunk)
                ids.astype(dtype).tofile(handles[split])
                counts[split] += len(ids)
                if len(ids):
                    max_ids[split] = max(max_ids[split], int(ids.max()))
            if eos is not None:
                eos.tofile(handles[split])
                counts[split] += 1
                max_ids[split] = max(max_ids[split], eos_id)
            documents_per_split[split] += 1
        for handle in handles.values():
            handle.close()
        for split in SPLITS:
            os.replace(temp_paths[split], os.path.join(out_dir, f"{split}.bin"))
    finally:
        for split in SPLITS:
            handles[split].close()
            if os.path.exists(temp_paths[split]):
                os.remove(temp_paths[split])

    meta = {
        "vocab_size": encoder.vocab_size,
        "dtype": token_dtype(encoder.vocab_size),
        "num_tokens": counts,
        # The largest id in each file: the trainer checks it against model.vocab_size at start
        # without reading the files again.
        "max_id": max_ids,
        "num_documents": documents_per_split,
        "tokenizer": encoder.name,
        "eos_id": eos_id,
    }
    with open(os.path.join(out_dir, "meta.json"), "w", encoding="utf-8") as handle:
        json.dump(meta, handle, indent=2)
        handle.write("\n")
    return meta


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # type: ignore[override]
        # Raise instead of printing usage, so every user error is the same single line.
        raise UserError(message)


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="python -m trainer.tokenize",
                     description="Tokenise text files into train.bin / val.bin / meta.json.")
    parser.add_argument("inputs", nargs="+", metavar="INPUT",
                        help="text files, or directories searched recursively (hidden ones skipped)")
    parser.add_argument("--out", required=True, metavar="DIR", help="output directory")
    parser.add_argument("--tokenizer", metavar="PATH",
                        help="Hugging Face tokenizer.json; byte-level (vocab 256) when omitted")
    parser.add_argument("--val-fraction", type=float, default=0.01,
                        help="share of documents (files) held out for validation (default 0.01)")
    parser.add_argument("--eos-id", type=int, default=None,
                        help="token id appended after every document")
    parser.add_argument("--glob", default="*.txt",
                        help="file-name pattern for files inside directories (default '*.txt')")
    return parser


def main(argv: list[str] | None = None) -> int:
    try:
        args = build_parser().parse_args(argv)
        encoder: Encoder = HFEncoder(args.tokenizer) if args.tokenizer else ByteEncoder()
        meta = tokenize_files(args.inputs, args.out, encoder, args.val_fraction, args.eos_id,
                              args.glob, DEFAULT_CHUNK_BYTES)
    except SystemExit as exit_request:  # --help
        return int(exit_request.code or 0)
    except (UserError, OSError) as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    counts = meta["num_tokens"]
    print(f"wrote {counts['train']} train and {counts['val']} val tokens "
          f"({meta['dtype']}, vocab {meta['vocab_size']}) to {os.path.abspath(args.out)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
