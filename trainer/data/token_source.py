"""`data=bytes`, `tokens` and `synthetic`: one flat token stream cut into windows of
data.seq_len + 1 tokens (trainer/data/tokens.py), read in the one seeded global order.

The checks here import neither torch nor numpy until a token file is read."""

from __future__ import annotations

import json
import os
from typing import TYPE_CHECKING, Optional

from trainer.config import ConfigError, DataConfig, require
from trainer.data.base import ModelFacts, Source

TOKEN_SCAN_CHUNK = 1 << 24  # tokens per read while looking for the largest id
BYTE_VOCAB = 256

if TYPE_CHECKING:
    from trainer.data.batches import Sampling


class TokenSource(Source):
    def run_tokenizer(self, d: DataConfig, own: Optional[str]) -> Optional[str]:
        """data=bytes: the ids are the bytes; tokens and synthetic: data.tokenizer if set."""
        from trainer.data.run_tokenizer import BYTES

        return BYTES if self.name == "bytes" else d.tokenizer

    def check_files(self, d: DataConfig, model: ModelFacts) -> None:
        if self.name == "tokens":
            require(bool(d.train_path), "data.train_path",
                    "data.source=tokens needs data.train_path=<file.bin> (see python -m "
                    "trainer.tokenize)")
            require(bool(d.val_path), "data.val_path",
                    "data.source=tokens needs data.val_path=<file.bin>")
            _check_token_files(d, model)
        if self.name == "bytes":
            require(model.vocab_size >= BYTE_VOCAB, model.vocab_key,
                    f"data.source=bytes needs a vocabulary of at least {BYTE_VOCAB}, got "
                    f"{model.vocab_size}")

    def check_deep(self, d: DataConfig, model: ModelFacts) -> None:
        """Every id in the token files is one the model can embed."""
        if self.name != "tokens":
            return
        from trainer.data.tokens import read_meta, token_file

        vocab = model.vocab_size
        for key, path in (("data.train_path", d.train_path), ("data.val_path", d.val_path)):
            if not path:
                raise ConfigError(key, "required when data.source=tokens")
            tokens = token_file(path, d.token_dtype, key)  # length and dtype width
            largest = largest_token_id(path, tokens, read_meta(path))
            if largest >= vocab:
                raise ConfigError(key, f"{path} holds token id {largest}, but model.vocab_size is "
                                  f"{vocab} (ids must be < {vocab}); raise model.vocab_size or "
                                  "tokenize with the model's tokenizer")

    def datasets(self, d: DataConfig, model: ModelFacts, sampling: Sampling,
                 preprocess: Optional[dict] = None) -> tuple:
        from trainer.data.tokens import build_datasets

        train, val, _ = build_datasets(self.name, d.seq_len, model.vocab_size, sampling.seed,
                                       d.train_path, d.val_path, d.token_dtype,
                                       d.max_corpus_bytes)
        return train, val


def _check_token_files(d: DataConfig, model: ModelFacts) -> None:
    """The files exist, fit the dtype and hold more than one sample; meta.json (written by
    `python -m trainer.tokenize`) agrees on the dtype and on a vocabulary the model embeds."""
    for key, path in (("data.train_path", d.train_path), ("data.val_path", d.val_path)):
        require(os.path.isfile(path), key, f"no such file: {path}")
    meta_path = os.path.join(os.path.dirname(os.path.abspath(d.train_path)), "meta.json")
    if os.path.isfile(meta_path):  # written by `python -m trainer.tokenize`; other tools have none
        try:
            with open(meta_path) as f:
                meta = json.load(f)
        except (OSError, ValueError) as exc:
            raise ConfigError("data.train_path", f"unreadable {meta_path}: {exc}") from exc
        dtype = meta.get("dtype", d.token_dtype)
        require(dtype == d.token_dtype, "data.token_dtype",
                f"{d.token_dtype} but {meta_path} says the files are {dtype}")
        data_vocab = int(meta.get("vocab_size", 0))
        require(data_vocab <= model.vocab_size, model.vocab_key,
                f"{model.vocab_size} is smaller than the tokenizer's vocabulary {data_vocab} "
                f"({meta_path})")
    width = 2 if d.token_dtype == "uint16" else 4
    for key, path in (("data.train_path", d.train_path), ("data.val_path", d.val_path)):
        size = os.path.getsize(path)
        require(size % width == 0, key, f"{path} is {size} bytes, not a multiple of {width} "
                f"({d.token_dtype}); is data.token_dtype right, or was the file cut short?")
        num_tokens = size // width
        require(num_tokens > d.seq_len, key,
                f"{path} holds {num_tokens} tokens, fewer than one sample of data.seq_len+1="
                f"{d.seq_len + 1}; lower data.seq_len or add data")


def largest_token_id(path: str, tokens, meta: Optional[dict]) -> int:
    """The largest id in a token file: from meta.json when the tokenize command recorded it for
    this file (same size), else a chunked scan of the memory map."""
    split = os.path.splitext(os.path.basename(path))[0]
    recorded = (meta or {}).get("max_id", {})
    counts = (meta or {}).get("num_tokens", {})
    if split in recorded and counts.get(split) == len(tokens):
        return int(recorded[split])
    largest = 0
    for start in range(0, len(tokens), TOKEN_SCAN_CHUNK):
        largest = max(largest, int(tokens[start:start + TOKEN_SCAN_CHUNK].max()))
    return largest
