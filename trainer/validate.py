"""Checks of a composed config that types cannot express: ranges, choices, files, and the
data-parallel layout against the world size. Each failure is a `ConfigError` naming the key."""

from __future__ import annotations

import os
from typing import Optional

from trainer.config import (CHOICES, DTYPES, SIGNALS, CheckpointingConfig, Config, ConfigError,
                            ModelConfig, TrainConfig, check_writable, require)
from trainer.data.base import ModelFacts
from trainer.data.factory import source_of
from trainer.models.families.attention_backend import check_attention
from trainer.models.families import family_of
from trainer.models.families.lora_settings import adapter_config
from sharding.layout import Layout, LayoutError, make_layout


def _get(cfg: Config, key: str):
    node = cfg
    for part in key.split("."):
        node = getattr(node, part)
    return node


def validate(cfg: Config, world_size: int, num_nodes: int = 1) -> Layout:
    """Checks every value a type cannot, against the world this run will have; the first
    mistake found (in this order) is the one reported."""
    _check_ranges(cfg)
    _check_auto(cfg.train, cfg.checkpointing.policy, cfg.logging.live_bytes_step)
    _check_checkpointing(cfg.checkpointing, cfg.train.compile)
    _check_run_control(cfg)
    _check_model_and_data(cfg)
    check_attention(cfg)
    check_lora(cfg.model)
    layout = _layout(cfg, world_size, num_nodes)
    _check_sequence(cfg, layout)
    _check_tiles(cfg, layout.least_degree, layout.context)
    return layout


def _is_count(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 1


def _check_sequence(cfg: Config, layout: Layout) -> None:
    """sharding.sequence against data.seq_len (the layout has checked the sharding, the world
    and, through the family, the model's heads)."""
    degree, context = layout.least_degree, layout.context
    if context > 1:
        chunks = 2 * context * degree
        require(cfg.data.seq_len % chunks == 0, "sharding.context",
                f"2 x sharding.context x sharding.sequence = {chunks} must divide data.seq_len="
                f"{cfg.data.seq_len}: each ring rank holds a balanced early and late chunk of "
                f"2 x {context}, split over its sequence group")
        # The ring runs its own kernels (the CPU flash or CUDA efficient one, for their
        # log-sum-exp): a named backend would be silently replaced.
        require(cfg.model.attention == "auto", "model.attention",
                f"{cfg.model.attention} cannot run under sharding.context={context}: the ring "
                "takes its own attention kernels; set model.attention=auto")
        return
    if degree == 1:
        return
    require(cfg.data.seq_len % degree == 0, "sharding.sequence",
            f"{degree} must divide data.seq_len={cfg.data.seq_len}: each rank holds an equal "
            "contiguous slice of every sample")


def _check_tiles(cfg: Config, degree: int, context: int = 1) -> None:
    """checkpointing.tiles: a count (or auto), for a family whose blocks have a token-wise MLP,
    at most one tile per token a rank holds."""
    c = cfg.checkpointing
    require(c.tiles == "auto" or _is_count(c.tiles), "checkpointing.tiles",
            f"must be a positive integer or auto, got {c.tiles!r}")
    if c.tiles in (1, "auto"):
        return
    require(c.policy != "file", "checkpointing.tiles",
            "checkpointing=file carries out the plan file's own tiles per block; leave "
            "checkpointing.tiles at 1")
    family = family_of(cfg.model)
    require(family.tileable, "checkpointing.tiles",
            f"model.arch={family.arch} has no token-wise MLP to tile (llama and hf have); "
            "set checkpointing.tiles=1")
    tokens = cfg.data.seq_len // (degree * context)
    held = (f"data.seq_len={cfg.data.seq_len} / sharding.sequence={degree}" if degree > 1
            else f"data.seq_len={cfg.data.seq_len}")
    if context > 1:
        held += f" / sharding.context={context}"
    require(c.tiles <= tokens, "checkpointing.tiles",
            f"{c.tiles} tiles for the {tokens} tokens a rank holds ({held}): at most one "
            "tile per token")


def _check_ranges(cfg: Config) -> None:
    """Choices, signs and ranges of single values."""
    family_of(cfg.model)  # model.arch first: the registry refuses an arch without a family
    source_of(cfg.data)  # then data.source: the sources refuse a name that is none of theirs
    for key, allowed in CHOICES.items():
        value = _get(cfg, key)
        require(value in allowed, key, f"got {value!r}; choose one of {', '.join(allowed)}")
    positive = ("model.dim", "model.n_layers", "model.n_heads", "model.n_kv_heads",
                "model.vocab_size", "model.ffn_hidden", "model.max_seq_len", "data.seq_len",
                "data.max_corpus_bytes", "train.steps",
                "train.grad_accum", "train.eval_every", "train.eval_batches",
                "train.dist_timeout_s", "logging.every", "checkpointing.every",
                "checkpointing.profile_repeats")
    for key in positive:
        value = _get(cfg, key)
        require(value > 0, key, f"must be a positive integer, got {value}")
    for key in ("optim.lr", "model.norm_eps", "model.rope_theta", "logging.wandb_init_timeout_s"):
        value = _get(cfg, key)
        require(value > 0, key, f"must be > 0, got {value}")
    for key in ("optim.weight_decay", "optim.grad_clip", "optim.warmup_steps", "optim.eps",
                "data.workers"):
        value = _get(cfg, key)
        require(value >= 0, key, f"must be >= 0, got {value}")
    for key in ("model.dropout", "optim.min_lr_ratio", "optim.beta1", "optim.beta2"):
        value = _get(cfg, key)
        require(0 <= value <= 1, key, f"must be between 0 and 1, got {value}")
    require(cfg.model.dropout < 1, "model.dropout", "must be below 1")
    for key in ("sharding.param_dtype", "sharding.reduce_dtype"):
        value = _get(cfg, key)
        require(value is None or value in DTYPES, key,
                f"got {value!r}; choose null or one of {', '.join(DTYPES)}")


def _check_auto(t: TrainConfig, policy: str, live_bytes_step: Optional[int]) -> None:
    """The micro-batch, the memory to fit and what `auto` needs."""
    auto_batch = t.micro_batch_size == "auto"
    require(auto_batch or (isinstance(t.micro_batch_size, int)
                           and not isinstance(t.micro_batch_size, bool)
                           and t.micro_batch_size > 0), "train.micro_batch_size",
            f"must be a positive integer or auto, got {t.micro_batch_size!r}")
    require(t.memory_gib is None or t.memory_gib > 0, "train.memory_gib",
            f"must be null or > 0 GiB, got {t.memory_gib}")
    require(t.memory_reserve_gib >= 0, "train.memory_reserve_gib",
            f"must be >= 0 GiB, got {t.memory_reserve_gib}")
    require(t.host_reserve_gib is None or t.host_reserve_gib >= 0, "train.host_reserve_gib",
            f"must be null or >= 0 GiB, got {t.host_reserve_gib}")
    fitting = auto_batch or policy == "auto"
    if fitting and t.memory_gib is None:
        what = ("checkpointing=auto" if policy == "auto"
                else "train.micro_batch_size=auto")
        require(t.device != "cpu", "train.memory_gib",
                f"{what} on CPU needs the memory one rank may use, e.g. train.memory_gib=2 "
                "(on CUDA it defaults to the device's memory)")
    if auto_batch:
        require(t.global_batch_size is not None, "train.global_batch_size",
                "train.micro_batch_size=auto needs the global batch fixed, e.g. "
                "train.global_batch_size=64")
        require(policy != "budget", "checkpointing",
                "budget fixes activation bytes, not the step's memory; with "
                "train.micro_batch_size=auto use checkpointing=auto (or a fixed policy)")
    require(live_bytes_step is None or live_bytes_step > 0,
            "logging.live_bytes_step", f"must be null or a step >= 1, got {live_bytes_step}")


def _check_checkpointing(c: CheckpointingConfig, compile_on: bool) -> None:
    """The policy's own settings, each refused where it does not apply."""
    if c.policy == "file":
        require(c.plan_file is not None and os.path.isfile(c.plan_file),
                "checkpointing.plan_file", f"checkpointing=file needs a plan.json of an earlier "
                f"run, got {c.plan_file!r}")
    else:
        require(c.plan_file is None, "checkpointing.plan_file",
                f"only applies to checkpointing=file (now checkpointing={c.policy})")
    if c.policy in ("budget", "compiler"):
        require(c.budget is not None and c.budget > 0, "checkpointing.budget",
                f"checkpointing={c.policy} needs checkpointing.budget=<bytes per rank, or a "
                "fraction <= 1 of the activation memory without checkpointing>")
    else:
        require(c.budget is None, "checkpointing.budget",
                f"only applies to checkpointing=budget or compiler (now checkpointing={c.policy})")
    require(c.policy != "compiler" or compile_on, "train.compile",
            "checkpointing=compiler leaves recompute to torch.compile's partitioner: set "
            "train.compile=true (or choose checkpointing=budget for the same budget in eager)")
    require(c.head_chunk_tokens is None or c.head_chunk_tokens > 0, "checkpointing.head_chunk_tokens",
            f"must be null (from checkpointing.head_budget_mib) or > 0, got {c.head_chunk_tokens}")
    require(c.head_budget_mib > 0, "checkpointing.head_budget_mib",
            f"must be > 0 MiB, got {c.head_budget_mib}")
    f = c.head_supervised_fraction
    require(f is None or 0 < f <= 1, "checkpointing.head_supervised_fraction",
            f"must be null (from the data cache) or in (0, 1], got {f}")
    if c.policy == "selective":
        require(len(c.save_ops) > 0, "checkpointing.save_ops",
                "selective checkpointing needs at least one op to keep, e.g. [mm,addmm]")


def _check_run_control(cfg: Config) -> None:
    """Offload, stopping, saving, faults and alerts."""
    o = cfg.offload
    for key in ("offload.min_bytes", "offload.keep_last"):
        require(_get(cfg, key) >= 0, key, f"must be >= 0, got {_get(cfg, key)}")
    for key in ("offload.max_host_bytes", "offload.max_inflight_bytes"):
        require(_get(cfg, key) > 0, key, f"must be a positive number of bytes, got {_get(cfg, key)}")
    if o.target == "disk":
        check_writable(o.dir or cfg.train.out_dir, "offload.dir" if o.dir else "train.out_dir")
    require(cfg.train.stop_at_step is None or 0 < cfg.train.stop_at_step, "train.stop_at_step",
            f"must be null or a positive step, got {cfg.train.stop_at_step}")
    sv, f = cfg.save, cfg.faults
    for key in ("save.every", "faults.max_rollbacks"):
        require(_get(cfg, key) >= 0, key, f"must be >= 0, got {_get(cfg, key)}")
    for key in ("save.keep", "faults.max_bad_steps", "faults.spike_window"):
        require(_get(cfg, key) > 0, key, f"must be a positive integer, got {_get(cfg, key)}")
    lg = cfg.logging
    require(lg.alert_interval_s >= 0, "logging.alert_interval_s",
            f"must be >= 0 seconds, got {lg.alert_interval_s}")
    require(0 <= lg.alert_throughput_fraction < 1, "logging.alert_throughput_fraction",
            f"must be in [0, 1) (0 turns the drift alert off), got {lg.alert_throughput_fraction}")
    require(lg.alert_throughput_window >= 5, "logging.alert_throughput_window",
            f"must be >= 5 steps, got {lg.alert_throughput_window}")
    require(f.inject_slow_s >= 0, "faults.inject_slow_s", f"must be >= 0, got {f.inject_slow_s}")
    for key in ("faults.inject_nan_at", "faults.inject_spike_at", "faults.inject_hang_at",
                "faults.inject_slow_at"):
        bad = [b for b in _get(cfg, key) if not (isinstance(b, int) and b >= 0)]
        require(not bad, key, f"data batch indices must be integers >= 0, got {bad}")
    require(f.spike_factor == 0 or f.spike_factor > 1, "faults.spike_factor",
            f"must be 0 (off) or above 1, got {f.spike_factor}")
    require(sv.signal is None or sv.signal in SIGNALS, "save.signal",
            f"got {sv.signal!r}; choose null or one of {', '.join(SIGNALS)}")
    require(0 <= sv.preempt_exit_code < 256, "save.preempt_exit_code",
            f"must be an exit status 0..255, got {sv.preempt_exit_code}")
    if sv.dir is not None:
        check_writable(sv.dir, "save.dir")
    if cfg.sharding.cpu_offload:
        require(cfg.sharding.mode != "none", "sharding.cpu_offload",
                "needs sharding=fsdp or hsdp (FSDP2 moves the shards to CPU memory)")


def _check_model_and_data(cfg: Config) -> None:
    """The data's own settings, the model, then the data against the model (its files too)."""
    source = source_of(cfg.data)
    source.check(cfg.data)
    family = family_of(cfg.model)
    source.check_reader(family.sample, family.arch)
    family.validate(cfg.model, cfg.data.seq_len)
    source.check_files(cfg.data, model_facts(cfg.model))


def check_lora(m: ModelConfig) -> None:
    """model.lora's values alone (its targets against the model: trainer/models/families/lora.py, in
    the pre-flight deep check and at the build)."""
    lora = m.lora
    if not lora.on:
        require(not lora.targets, "model.lora.targets", "adapters are on with "
                "model.lora.rank; set it (e.g. 16) or leave the targets empty")
        require(lora.quantize == "none", "model.lora.quantize", f"{lora.quantize} quantizes "
                "the frozen base of LoRA; set model.lora.rank (e.g. 16) or quantize=none")
        require(lora.adapter is None, "model.lora.adapter", "starts LoRA's adapters; set "
                "model.lora.rank (and alpha) as the adapter's, or leave it null")
        return
    require(isinstance(lora.rank, int) and lora.rank > 0, "model.lora.rank",
            f"must be a positive integer (or null: no LoRA), got {lora.rank}")
    require(family_of(m).takes_lora, "model.lora.rank", f"LoRA adapts language models, not "
            f"model.arch={m.arch}; set it to null")
    require(lora.alpha > 0, "model.lora.alpha", f"must be > 0, got {lora.alpha}")
    require(0 <= lora.dropout < 1, "model.lora.dropout",
            f"must be at least 0 and below 1, got {lora.dropout}")
    require(not m.freeze, "model.freeze", "with LoRA the whole base is frozen already; "
            "leave model.freeze empty (choose the adapted layers with model.lora.targets)")
    if lora.adapter is not None:
        adapter_config(lora, m.path)


def model_facts(m: ModelConfig) -> ModelFacts:
    """What the data needs to know of the model, from its family (read once the model's
    settings are valid: an HF model's vocabulary comes from its config)."""
    family = family_of(m)
    return ModelFacts(family.vocab_size(m), family.vocab_key, family.own_tokenizer(m),
                      path=m.path, image_size=m.image_size, channels=m.channels,
                      num_classes=m.num_classes)


def _layout(cfg: Config, world_size: int, num_nodes: int) -> Layout:
    """The parallel layout (sharding/layout.py): replicas x shards, sequence groups, and the
    gradient accumulation that makes the global batch."""
    s, t = cfg.sharding, cfg.train
    if s.mode == "none":
        for key in ("sharding.param_dtype", "sharding.reduce_dtype"):
            require(_get(cfg, key) is None, key, "mixed precision needs sharding=fsdp or hsdp")
    try:
        return make_layout(s.mode, world_size, s.replicate, s.sequence, t.micro_batch_size,
                           t.grad_accum, t.global_batch_size, num_nodes,
                           lambda degree: family_of(cfg.model).check_sequence(cfg.model, degree),
                           s.context,
                           lambda context: family_of(cfg.model).check_context(
                               cfg.model, context, cfg.train.compile))
    except LayoutError as exc:
        raise ConfigError(exc.key, exc.message) from None
