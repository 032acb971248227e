"""Typed configuration schema and validation.

The YAML files in conf/ supply values; these dataclasses, registered in Hydra's ConfigStore as
`schema`, fix the set of keys and their types, so Hydra rejects unknown keys and wrong types while
composing. `validate` then checks what types cannot (ranges, choices, divisibility against the
world size) and raises `ConfigError` naming the key to change. Nothing here imports torch: a bad
command line is refused in well under a second, before any process group exists.
"""

from __future__ import annotations

import json
import os
import tempfile
from dataclasses import dataclass, field
from typing import Any, List, Optional

from hydra.core.config_store import ConfigStore


# Kept in sync with checkpointing/wrap.py (which needs torch); a test checks they agree.
DEFAULT_SAVE_OPS = (
    "mm", "addmm", "bmm", "baddbmm",
    "_scaled_dot_product_flash_attention", "_scaled_dot_product_efficient_attention",
    "_scaled_dot_product_cudnn_attention", "_scaled_dot_product_flash_attention_for_cpu",
)


class ConfigError(ValueError):
    """A user mistake in the configuration; the message names the key and what is allowed."""

    def __init__(self, key: str, message: str):
        super().__init__(f"{key}: {message}")
        self.key = key


@dataclass
class ModelConfig:
    name: str = "tiny"  # preset name, for logs and run names
    arch: str = "llama"
    dim: int = 128
    n_layers: int = 4
    n_heads: int = 4
    n_kv_heads: int = 2
    vocab_size: int = 256
    ffn_hidden: int = 384
    max_seq_len: int = 512
    norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    dropout: float = 0.0
    tie_embeddings: bool = False
    # Module-path glob of the blocks (e.g. "layers.*"); null finds the repeated blocks itself.
    block_pattern: Optional[str] = None
    # arch=hf: a Hugging Face causal LM, from a local pretrained folder (config.json and
    # *.safetensors; nothing is downloaded) or built from hf_config ({model_type: llama, ...},
    # random init). Dropout and shapes then come from the HF config; the fields above are unused.
    path: Optional[str] = None
    hf_config: Optional[Any] = None
    attn_implementation: str = "sdpa"
    # Parameters to freeze (not trained, no optimizer state): globs over parameter names as the
    # model names them, e.g. ["hf.model.embed_tokens.*", "hf.model.layers.[0-5].*"].
    freeze: List[str] = field(default_factory=list)


@dataclass
class DataConfig:
    source: str = "bytes"  # bytes | tokens | synthetic
    seq_len: int = 256
    train_path: Optional[str] = None
    val_path: Optional[str] = None
    token_dtype: str = "uint16"
    max_corpus_bytes: int = 32 * 1024 * 1024


@dataclass
class OptimConfig:
    lr: float = 3e-3
    min_lr_ratio: float = 0.1
    warmup_steps: int = 20
    weight_decay: float = 0.1
    beta1: float = 0.9
    beta2: float = 0.95
    eps: float = 1e-8
    grad_clip: float = 1.0  # max global grad norm; 0 turns clipping off


@dataclass
class TrainConfig:
    steps: int = 300
    seed: int = 0
    micro_batch_size: int = 16
    grad_accum: int = 1
    # When set, grad_accum is derived: global_batch_size / (micro_batch_size * data-parallel size).
    global_batch_size: Optional[int] = None
    eval_every: int = 50
    eval_batches: int = 4
    run_name: Optional[str] = None
    out_dir: str = "outputs"
    device: str = "auto"  # auto | cpu | cuda
    compile: bool = False  # torch.compile each block (after its checkpoint wrapper)
    dist_timeout_s: int = 600
    # End this process after this step, saving first, as a preemption would (exit status
    # save.preempt_exit_code); started again, the run continues. For time-sliced jobs and drills.
    stop_at_step: Optional[int] = None


@dataclass
class ShardingConfig:
    mode: str = "fsdp"  # fsdp | hsdp | none
    replicate: Optional[int] = None  # HSDP replica groups; null = number of nodes
    reshard_after_forward: bool = True
    param_dtype: Optional[str] = None  # null keeps fp32 compute; bfloat16 | float16 | float32
    reduce_dtype: Optional[str] = None
    # Parameters, gradients and optimizer state live in CPU memory (FSDP2 CPUOffloadPolicy).
    cpu_offload: bool = False


@dataclass
class CheckpointingConfig:
    policy: str = "none"  # none | full | every_k | sqrt | selective | budget
    every: int = 2  # every_k: recompute every k-th block
    # selective: aten ops whose outputs are kept (matmuls, attention); the rest is recomputed.
    save_ops: List[str] = field(default_factory=lambda: list(DEFAULT_SAVE_OPS))
    # budget: activation bytes per rank for the whole step (> 1), or a fraction (<= 1) of the
    # activation bytes without checkpointing.
    budget: Optional[float] = None
    profile_repeats: int = 3  # timing repeats per option when profiling a block


@dataclass
class OffloadConfig:
    target: str = "none"  # none | cpu | disk
    min_bytes: int = 1 << 20  # smaller saved tensors stay on the device
    keep_last: int = 1  # the last blocks run backward first: keep theirs on the device
    max_host_bytes: int = 8 << 30  # cpu on CUDA: bound of the reused pinned host pool
    dir: Optional[str] = None  # disk: folder for the files; null = <run dir>/offload
    max_inflight_bytes: int = 256 << 20  # disk: bytes waiting to be written before forward waits
    trim_heap: bool = True  # disk on CPU: free heap pages go back to the system as backward starts


@dataclass
class LoggingConfig:
    every: int = 10
    progress: bool = True
    wandb: bool = True
    wandb_project: str = "blocktrain"
    wandb_entity: Optional[str] = None
    wandb_init_timeout_s: float = 60.0


@dataclass
class SaveConfig:
    """Training-state checkpoints (model, optimizer, schedule, data position, RNG): trainer/state.py."""

    every: int = 100  # save after every N optimizer steps; 0: only at the end and on preemption
    keep: int = 2  # committed checkpoints kept; older ones go once a newer one is committed
    async_save: bool = False  # write in a thread after copying the state to CPU memory
    at_end: bool = True  # also save after the last step
    resume: bool = True  # a run starting in a folder with checkpoints continues from the newest
    dir: Optional[str] = None  # null = <run dir>/checkpoints
    signal: Optional[str] = "SIGUSR1"  # besides SIGTERM: finish the step, save, exit
    preempt_exit_code: int = 75  # exit status after a preemption save (EX_TEMPFAIL: run me again)


@dataclass
class FaultsConfig:
    """Bad steps: skipped, and rolled back to the last checkpoint when they persist."""

    skip_nonfinite: bool = True  # a NaN/inf loss or gradient norm skips the update
    max_bad_steps: int = 3  # this many skipped steps in a row roll back to the last checkpoint
    spike_factor: float = 4.0  # loss above this x the recent median rolls back; 0 turns it off
    spike_window: int = 50  # recent good steps the median is taken over
    max_rollbacks: int = 5  # more rollbacks than this in one run stop it
    # Drills and tests: faults injected at these data-batch indices (0-based).
    inject_nan_at: List[int] = field(default_factory=list)
    inject_spike_at: List[int] = field(default_factory=list)
    inject_hang_at: List[int] = field(default_factory=list)  # the last rank stalls there


@dataclass
class Config:
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    sharding: ShardingConfig = field(default_factory=ShardingConfig)
    checkpointing: CheckpointingConfig = field(default_factory=CheckpointingConfig)
    offload: OffloadConfig = field(default_factory=OffloadConfig)
    save: SaveConfig = field(default_factory=SaveConfig)
    faults: FaultsConfig = field(default_factory=FaultsConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)


def register_schema() -> None:
    ConfigStore.instance().store(name="schema", node=Config)


DTYPES = ("float32", "bfloat16", "float16")
CHOICES = {
    "model.arch": ("llama", "hf"),
    "data.source": ("bytes", "tokens", "synthetic"),
    "data.token_dtype": ("uint16", "uint32"),
    "train.device": ("auto", "cpu", "cuda"),
    "sharding.mode": ("fsdp", "hsdp", "none"),
    "checkpointing.policy": ("none", "full", "every_k", "sqrt", "selective", "budget"),
    "offload.target": ("none", "cpu", "disk"),
}


# Signals a launcher may send ahead of a time limit (SIGTERM is always handled).
SIGNALS = ("SIGUSR1", "SIGUSR2", "SIGINT", "SIGHUP", "SIGTERM")


@dataclass(frozen=True)
class Layout:
    """What validation derives from the config and the world: the data-parallel layout."""

    world_size: int
    replicate: int  # HSDP replica groups (1 for fsdp / none)
    shard: int  # ranks a parameter is sharded over
    grad_accum: int
    global_batch_size: int  # sequences per optimizer step


def _get(cfg: Config, key: str):
    node = cfg
    for part in key.split("."):
        node = getattr(node, part)
    return node


def _require(cond: bool, key: str, message: str) -> None:
    if not cond:
        raise ConfigError(key, message)


def _check_token_files(data: DataConfig, vocab_size: int) -> None:
    for key, path in (("data.train_path", data.train_path), ("data.val_path", data.val_path)):
        _require(os.path.isfile(path), key, f"no such file: {path}")
    meta_path = os.path.join(os.path.dirname(os.path.abspath(data.train_path)), "meta.json")
    if os.path.isfile(meta_path):  # written by `python -m trainer.tokenize`; other tools have none
        try:
            with open(meta_path) as f:
                meta = json.load(f)
        except (OSError, ValueError) as exc:
            raise ConfigError("data.train_path", f"unreadable {meta_path}: {exc}") from exc
        dtype = meta.get("dtype", data.token_dtype)
        _require(dtype == data.token_dtype, "data.token_dtype",
                 f"{data.token_dtype} but {meta_path} says the files are {dtype}")
        data_vocab = int(meta.get("vocab_size", 0))
        _require(data_vocab <= vocab_size, "model.vocab_size",
                 f"{vocab_size} is smaller than the tokenizer's vocabulary {data_vocab} "
                 f"({meta_path})")
    width = 2 if data.token_dtype == "uint16" else 4
    for key, path in (("data.train_path", data.train_path), ("data.val_path", data.val_path)):
        num_tokens = os.path.getsize(path) // width
        _require(num_tokens > data.seq_len, key,
                 f"{path} holds {num_tokens} tokens, fewer than one sample of data.seq_len+1="
                 f"{data.seq_len + 1}; lower data.seq_len or add data")


def _check_writable(path: str, key: str) -> None:
    """The nearest existing folder on the way to `path` must be writable, so the run can create it."""
    probe = os.path.abspath(path)
    while not os.path.exists(probe):
        parent = os.path.dirname(probe)
        if parent == probe:
            break
        probe = parent
    writable = os.path.isdir(probe) and os.access(probe, os.W_OK | os.X_OK)
    if writable:  # access() says yes to root even on read-only file systems: really try
        try:
            fd, name = tempfile.mkstemp(prefix=".blocktrain-probe-", dir=probe)
            os.close(fd)
            os.unlink(name)
        except OSError:
            writable = False
    _require(writable, key, f"{path} is not writable (checked {probe}); choose a writable folder")


def validate(cfg: Config, world_size: int, num_nodes: int = 1) -> Layout:
    """Checks every value a type cannot, against the world this run will have."""
    for key, allowed in CHOICES.items():
        value = _get(cfg, key)
        _require(value in allowed, key, f"got {value!r}; choose one of {', '.join(allowed)}")
    positive = ("model.dim", "model.n_layers", "model.n_heads", "model.n_kv_heads",
                "model.vocab_size", "model.ffn_hidden", "model.max_seq_len", "data.seq_len",
                "data.max_corpus_bytes", "train.steps", "train.micro_batch_size",
                "train.grad_accum", "train.eval_every", "train.eval_batches",
                "train.dist_timeout_s", "logging.every", "checkpointing.every",
                "checkpointing.profile_repeats")
    for key in positive:
        value = _get(cfg, key)
        _require(value > 0, key, f"must be a positive integer, got {value}")
    for key in ("optim.lr", "model.norm_eps", "model.rope_theta", "logging.wandb_init_timeout_s"):
        value = _get(cfg, key)
        _require(value > 0, key, f"must be > 0, got {value}")
    for key in ("optim.weight_decay", "optim.grad_clip", "optim.warmup_steps", "optim.eps"):
        value = _get(cfg, key)
        _require(value >= 0, key, f"must be >= 0, got {value}")
    for key in ("model.dropout", "optim.min_lr_ratio", "optim.beta1", "optim.beta2"):
        value = _get(cfg, key)
        _require(0 <= value <= 1, key, f"must be between 0 and 1, got {value}")
    _require(cfg.model.dropout < 1, "model.dropout", "must be below 1")
    for key in ("sharding.param_dtype", "sharding.reduce_dtype"):
        value = _get(cfg, key)
        _require(value is None or value in DTYPES, key,
                 f"got {value!r}; choose null or one of {', '.join(DTYPES)}")

    c = cfg.checkpointing
    if c.policy == "budget":
        _require(c.budget is not None and c.budget > 0, "checkpointing.budget",
                 "checkpointing=budget needs checkpointing.budget=<bytes per rank, or a fraction "
                 "<= 1 of the activation memory without checkpointing>")
    else:
        _require(c.budget is None, "checkpointing.budget",
                 f"only applies to checkpointing=budget (now checkpointing={c.policy})")
    if c.policy == "selective":
        _require(len(c.save_ops) > 0, "checkpointing.save_ops",
                 "selective checkpointing needs at least one op to keep, e.g. [mm,addmm]")

    o = cfg.offload
    for key in ("offload.min_bytes", "offload.keep_last"):
        _require(_get(cfg, key) >= 0, key, f"must be >= 0, got {_get(cfg, key)}")
    for key in ("offload.max_host_bytes", "offload.max_inflight_bytes"):
        _require(_get(cfg, key) > 0, key, f"must be a positive number of bytes, got {_get(cfg, key)}")
    _require(not (cfg.train.compile and o.target != "none"), "train.compile",
             f"true does not combine with offload={o.target} yet (saved-tensor hooks inside "
             "compiled blocks); set train.compile=false or offload=none")
    if o.target == "disk":
        _check_writable(o.dir or cfg.train.out_dir, "offload.dir" if o.dir else "train.out_dir")
    _require(cfg.train.stop_at_step is None or 0 < cfg.train.stop_at_step, "train.stop_at_step",
             f"must be null or a positive step, got {cfg.train.stop_at_step}")
    sv, f = cfg.save, cfg.faults
    for key in ("save.every", "faults.max_rollbacks"):
        _require(_get(cfg, key) >= 0, key, f"must be >= 0, got {_get(cfg, key)}")
    for key in ("save.keep", "faults.max_bad_steps", "faults.spike_window"):
        _require(_get(cfg, key) > 0, key, f"must be a positive integer, got {_get(cfg, key)}")
    _require(f.spike_factor == 0 or f.spike_factor > 1, "faults.spike_factor",
             f"must be 0 (off) or above 1, got {f.spike_factor}")
    _require(sv.signal is None or sv.signal in SIGNALS, "save.signal",
             f"got {sv.signal!r}; choose null or one of {', '.join(SIGNALS)}")
    _require(0 < sv.preempt_exit_code < 256, "save.preempt_exit_code",
             f"must be an exit status 1..255, got {sv.preempt_exit_code}")
    if sv.dir is not None:
        _check_writable(sv.dir, "save.dir")
    if cfg.sharding.cpu_offload:
        _require(cfg.sharding.mode != "none", "sharding.cpu_offload",
                 "needs sharding=fsdp or hsdp (FSDP2 moves the shards to CPU memory)")

    m = cfg.model
    if m.arch == "hf":
        from trainer.hf_settings import check_hf

        check_hf(cfg)
    _require(m.dim % m.n_heads == 0, "model.n_heads",
             f"must divide model.dim={m.dim}, got {m.n_heads}")
    _require((m.dim // m.n_heads) % 2 == 0, "model.n_heads",
             f"head size model.dim/model.n_heads={m.dim // m.n_heads} must be even (rotary)")
    _require(m.n_heads % m.n_kv_heads == 0, "model.n_kv_heads",
             f"must divide model.n_heads={m.n_heads}, got {m.n_kv_heads}")
    _require(cfg.data.seq_len <= m.max_seq_len, "data.seq_len",
             f"{cfg.data.seq_len} exceeds model.max_seq_len={m.max_seq_len}")
    if cfg.data.source == "tokens":
        _require(bool(cfg.data.train_path), "data.train_path",
                 "data.source=tokens needs data.train_path=<file.bin> (see python -m trainer.tokenize)")
        _require(bool(cfg.data.val_path), "data.val_path",
                 "data.source=tokens needs data.val_path=<file.bin>")
        _check_token_files(cfg.data, m.vocab_size)
    if cfg.data.source == "bytes":
        from trainer.hf_settings import model_vocab_size

        vocab = model_vocab_size(m)
        _require(vocab >= 256, "model.vocab_size" if m.arch != "hf" else "model.hf_config",
                 f"data.source=bytes needs a vocabulary of at least 256, got {vocab}")

    s = cfg.sharding
    if s.mode == "none":
        for key in ("sharding.param_dtype", "sharding.reduce_dtype"):
            _require(_get(cfg, key) is None, key, "mixed precision needs sharding=fsdp or hsdp")
    if s.mode != "hsdp":
        _require(s.replicate is None, "sharding.replicate",
                 f"only applies to sharding=hsdp (now sharding={s.mode})")
        replicate = 1
    else:
        replicate = num_nodes if s.replicate is None else s.replicate
        _require(replicate > 0, "sharding.replicate", f"must be a positive integer, got {replicate}")
        _require(world_size % replicate == 0, "sharding.replicate",
                 f"{replicate} does not divide the world size {world_size}")
    shard = world_size // replicate if s.mode != "none" else 1

    t = cfg.train
    per_accum = t.micro_batch_size * world_size
    if t.global_batch_size is None:
        grad_accum = t.grad_accum
    else:
        _require(t.global_batch_size > 0, "train.global_batch_size",
                 f"must be a positive integer, got {t.global_batch_size}")
        _require(t.grad_accum == 1, "train.grad_accum",
                 "set either train.grad_accum or train.global_batch_size, not both")
        _require(t.global_batch_size % per_accum == 0, "train.global_batch_size",
                 f"{t.global_batch_size} is not divisible by train.micro_batch_size x world size "
                 f"= {t.micro_batch_size} x {world_size}")
        grad_accum = t.global_batch_size // per_accum
    return Layout(world_size=world_size, replicate=replicate, shard=shard,
                  grad_accum=grad_accum, global_batch_size=per_accum * grad_accum)
