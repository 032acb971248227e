"""Checks that need torch, transformers or the data, run before Hydra makes the run directory.

`validate` (trainer/validate.py) checks what the config's values alone can tell, without torch.
Some mistakes only show against the libraries or the files: an op name aten does not have, a
block pattern that matches no module, a Hugging Face model type transformers does not know, a
token file of the wrong length or with ids the model cannot embed. Found here, they are one
line and exit status 2 with nothing written, instead of a traceback after the run started.
Each check runs only when its setting is in play, so a plain run pays nothing for it.
"""

from __future__ import annotations

import re

from trainer.config import DEFAULT_SAVE_OPS, Config, ConfigError
from trainer.models.families import family_of

# Messages of our own errors start with the setting to change ("data.train_path: ..." or
# "model.block_pattern='x' ..."); this finds it.
_KEY = re.compile(r"^((?:model|data|train|optim|sharding|checkpointing|offload|save|faults|"
                  r"logging)(?:\.\w+)+)")


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
        family_of(cfg.model).check_deep(cfg.model)
        _blocks(cfg)
        _lora(cfg)
        _data(cfg)
        _head(cfg)
        _sequence(cfg, layout)
        if layout is not None:
            _memory(cfg, layout, gpus_per_node)
            _host(cfg, layout, gpus_per_node)
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
    from trainer.preflight.auto_plan import GIB, at_micro_batch, auto_decides, decide, flop_timing

    if not auto_decides(cfg, layout) or cfg.train.memory_gib is None:
        return
    import torch

    from trainer.preflight.scenario import Evaluator, Scenario

    cpu = cfg.train.device == "cpu" or (cfg.train.device == "auto"
                                        and not torch.cuda.is_available())
    evaluator = Evaluator(1.0, optimizer_foreach=not cpu, device_type="cpu" if cpu else "cuda")
    scenario = Scenario(cfg, layout, gpus_per_node)
    # The least memory: micro-batch 1 when auto chooses it (1 divides every share).
    least = 1 if layout.micro_batch == "auto" else layout.micro_batch_size
    smallest = at_micro_batch(scenario, least)
    decide(smallest.cfg, smallest, evaluator, int(cfg.train.memory_gib * GIB),
           flop_timing(evaluator))


def _host(cfg: Config, layout, gpus_per_node: int) -> None:
    """A plan that pins more host memory per node than the node has (less
    train.host_reserve_gib): one line before training (trainer/preflight/host_memory.py)."""
    if cfg.offload.target != "cpu" and not cfg.sharding.cpu_offload:
        return
    import torch

    from trainer.preflight.host_memory import check_node

    cuda = cfg.train.device == "cuda" or (cfg.train.device == "auto"
                                          and torch.cuda.is_available())
    check_node(cfg, layout, gpus_per_node, "cuda" if cuda else "cpu")


def _blocks(cfg: Config) -> None:
    if cfg.model.block_pattern is None:
        return
    from trainer.build import build_on_meta, find_model_blocks

    find_model_blocks(build_on_meta(cfg.model), cfg.model)


def _lora(cfg: Config) -> None:
    """model.lora: its targets (and what quantize needs) against the meta model, which
    build_on_meta adapts (trainer/models/families/lora.py refuses a pattern matching no layer)."""
    if cfg.model.lora.on:
        from trainer.build import build_on_meta

        build_on_meta(cfg.model)


def _sequence(cfg: Config, layout) -> None:
    """sharding.sequence > 1 on the meta model (an HF model's attention in the registry, its
    heads however its config names them); checkpointing.tiles > 1: every block has the MLP its
    family tiles."""
    family, tiles = family_of(cfg.model), cfg.checkpointing.tiles
    degree = 1 if layout is None else layout.least_degree
    if degree > 1 or layout is not None and layout.context > 1:  # the ring needs the hook too
        family.check_sequence_parallel(cfg.model, degree)
    if isinstance(tiles, int) and tiles > 1:
        from trainer.build import build_on_meta, find_model_blocks

        names, blocks = find_model_blocks(build_on_meta(cfg.model), cfg.model)
        missing = [n for n, b in zip(names, blocks) if family.mlp_of(b) is None]
        if missing:
            raise ConfigError("checkpointing.tiles", f"blocks {', '.join(missing[:3])} have no "
                              "token-wise MLP (`mlp`) to tile; set checkpointing.tiles=1")


def _data(cfg: Config) -> None:
    """The data's files against the libraries and the model (token ids, tokenizer, fields)."""
    from trainer.data.factory import source_of
    from trainer.validate import model_facts

    source_of(cfg.data).check_deep(cfg.data, model_facts(cfg.model))


def _head(cfg: Config) -> None:
    """checkpointing.head=chunked: what the fused chunked head needs of the model (its family
    says: a language model's chunk of fp32 logits fits the budget, and its logits are
    hidden @ W.T)."""
    if cfg.checkpointing.head == "chunked":
        family_of(cfg.model).check_head(cfg.model, cfg.checkpointing)
