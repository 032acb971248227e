"""Checks that need torch, transformers or the data, run before Hydra makes the run directory.

`validate` (trainer/validate.py) checks what the config's values alone can tell, without torch.
Some mistakes only show against the libraries or the files: an op name aten does not have, a
block pattern that matches no module, a Hugging Face model type transformers does not know, a
token file of the wrong length or with ids the model cannot embed. Found here, they are one
line and exit status 2 with nothing written, instead of a traceback after the run started.
Each check runs only when its setting is in play, so a plain run pays nothing for it.
"""

from __future__ import annotations

import os
import re

from trainer.config import DEFAULT_SAVE_OPS, Config, ConfigError
from trainer.models.families import family_of

# Messages of our own errors start with the setting to change ("data.train_path: ..." or
# "model.block_pattern='x' ..."); this finds it.
_KEY = re.compile(r"^((?:model|data|train|optim|sharding|checkpointing|offload|save|faults|"
                  r"logging)(?:\.\w+)+)")
TOKEN_SCAN_CHUNK = 1 << 24  # tokens per read while looking for the largest id


def setting_of(message: str) -> str | None:
    """The config key an error message starts with, if it names one."""
    match = _KEY.match(message)
    return match.group(1) if match else None


def as_config_error(exc: Exception, fallback: str = "config") -> ConfigError:
    message = str(exc)
    key = setting_of(message)
    if key and message[len(key):len(key) + 2] == ": ":
        message = message[len(key) + 2:]  # "key: what" keeps what
    elif key and message[len(key):len(key) + 1] == "=":
        message = message[len(key) + 1:]  # "key=value what" keeps "value what"
    return ConfigError(key or fallback, message)


def deep_check(cfg: Config, layout=None, gpus_per_node: int = 1) -> None:
    """Raises ConfigError for the mistakes above; see the module docstring."""
    try:
        _save_ops(cfg)
        family_of(cfg.model).preflight(cfg.model)
        _blocks(cfg)
        _token_files(cfg)
        _documents(cfg)
        _head(cfg)
        if layout is not None:
            _memory(cfg, layout, gpus_per_node)
    except ValueError as exc:
        if isinstance(exc, ConfigError):
            raise
        raise as_config_error(exc) from exc


def _save_ops(cfg: Config) -> None:
    c = cfg.checkpointing
    if c.policy in ("selective", "budget") and tuple(c.save_ops) != DEFAULT_SAVE_OPS:
        from checkpointing.wrap import resolve_ops

        resolve_ops(c.save_ops)


def _memory(cfg: Config, layout, gpus_per_node: int) -> None:
    """checkpointing=auto or micro_batch_size=auto with a train.memory_gib that not even the
    smallest micro-batch fits: the trainer's own one line, before anything starts. The memory
    model alone decides this (no timing), at the smallest candidate (the least memory)."""
    from trainer.preflight.auto_plan import (GIB, at_micro_batch, decide, fitting, flop_timing,
                                             micro_batches)

    if not fitting(cfg) or cfg.train.memory_gib is None:
        return
    import torch

    from trainer.preflight.scenario import Evaluator, Scenario

    cpu = cfg.train.device == "cpu" or (cfg.train.device == "auto"
                                        and not torch.cuda.is_available())
    evaluator = Evaluator(1.0, optimizer_foreach=not cpu, device_type="cpu" if cpu else "cuda")
    scenario = Scenario(cfg, layout, gpus_per_node)
    smallest = at_micro_batch(scenario, micro_batches(cfg, layout)[-1])
    decide(smallest.cfg, smallest, evaluator, int(cfg.train.memory_gib * GIB),
           flop_timing(evaluator))


def _blocks(cfg: Config) -> None:
    if cfg.model.block_pattern is None:
        return
    from trainer.build import build_on_meta, find_model_blocks

    find_model_blocks(build_on_meta(cfg.model), cfg.model)


def _token_files(cfg: Config) -> None:
    d = cfg.data
    if d.source != "tokens":
        return
    from trainer.data.tokens import read_meta, token_file

    vocab = family_of(cfg.model).vocab_size(cfg.model)
    for key, path in (("data.train_path", d.train_path), ("data.val_path", d.val_path)):
        if not path:
            raise ConfigError(key, "required when data.source=tokens")
        tokens = token_file(path, d.token_dtype, key)  # length and dtype width
        largest = largest_token_id(path, tokens, read_meta(path))
        if largest >= vocab:
            raise ConfigError(key, f"{path} holds token id {largest}, but model.vocab_size is "
                              f"{vocab} (ids must be < {vocab}); raise model.vocab_size or "
                              "tokenize with the model's tokenizer")


def _head(cfg: Config) -> None:
    """checkpointing.head=chunked: the chunk's fp32 logits fit the budget, and the model's
    logits are hidden @ W.T (no bias, scale or soft-capping) so the fused head gives them."""
    c, family = cfg.checkpointing, family_of(cfg.model)
    if c.head != "chunked" or not family.language_model:
        return  # image models keep their own (small) head
    vocab, budget = family.vocab_size(cfg.model), c.head_budget_mib * 2**20
    tokens = c.head_chunk_tokens or 1
    if tokens * vocab * 4 > budget:
        what = (f"checkpointing.head_chunk_tokens={c.head_chunk_tokens} tokens" if
                c.head_chunk_tokens else "one token")
        raise ConfigError("checkpointing.head_budget_mib", f"{what} of a {vocab:,}-word "
                          f"vocabulary is {tokens * vocab * 4 / 2**20:.1f} MiB of fp32 logits, "
                          f"over the budget of {c.head_budget_mib} MiB: raise it, or lower "
                          "checkpointing.head_chunk_tokens")
    family.check_fused_head(cfg.model)


def _documents(cfg: Config) -> None:
    """data=text / chat: the files are there and have the field, the tokenizer loads (with a
    chat template for chat) and fits the model's vocabulary. The first record is enough."""
    d = cfg.data
    if d.source not in ("text", "chat"):
        return
    from trainer.data.sources import (DataError, check_fields, document_settings,
                                      first_record_fields, load_tokenizer)

    try:
        fields = first_record_fields(d.path, d.split)
        if fields is not None:
            check_fields(fields, document_settings(d), d.path)
        tokenizer = load_tokenizer(d.tokenizer or cfg.model.path, d.source)
    except DataError as exc:
        raise as_config_error(exc) from None
    vocab = family_of(cfg.model).vocab_size(cfg.model)
    if len(tokenizer) > vocab:
        raise ConfigError("model.vocab_size", f"the tokenizer {d.tokenizer or cfg.model.path} "
                          f"has {len(tokenizer)} ids, more than the model's {vocab}")


def largest_token_id(path: str, tokens, meta: dict | None) -> int:
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

