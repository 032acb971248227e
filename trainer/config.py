"""Typed configuration schema. conf/'s YAML supplies values; these dataclasses, registered in
Hydra's ConfigStore as `schema`, fix the keys and their types; trainer/validate.py checks the
rest and raises `ConfigError` naming the key. No torch here: a bad command line is refused in
well under a second, before any process group exists."""

from __future__ import annotations

import os
import tempfile
from dataclasses import dataclass, field
from typing import Any, List, Optional

from hydra.core.config_store import ConfigStore

# Selective checkpointing's default ops live beside the plan (checkpointing/plan.py, no torch),
# so the config schema and the wrapper share one list without an upward import.
from checkpointing.plan import DEFAULT_SAVE_OPS


class ConfigError(ValueError):
    """A user mistake in the configuration; the message names the key and what is allowed."""

    def __init__(self, key: str, message: str):
        super().__init__(f"{key}: {message}")
        self.key = key


def require(cond: bool, key: str, message: str) -> None:
    """Raise the ConfigError naming `key` unless `cond` holds."""
    if not cond:
        raise ConfigError(key, message)


def check_writable(path: str, key: str) -> None:
    """The nearest existing folder on the way to `path` must be writable, so the run can create it."""
    probe = os.path.abspath(path)
    require(not os.path.exists(probe) or os.path.isdir(probe), key,
            f"{path} exists and is not a folder; choose a folder")
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
    require(writable, key, f"{path} is not writable (checked {probe}); choose a writable folder")


@dataclass
class LoraSettings:
    """model.lora: low-rank adapters on a frozen base (trainer/models/families/lora.py, through PEFT)."""

    rank: Optional[int] = None  # null: no LoRA, every weight trains; else only the adapters
    alpha: float = 16.0  # the adapters' update is scaled by alpha / rank (PEFT's lora_alpha)
    dropout: float = 0.0  # on the adapters' input (PEFT's lora_dropout)
    # Module-name globs of the linear layers adapted (e.g. "*.q_proj"); empty: every linear
    # layer inside the blocks.
    targets: List[str] = field(default_factory=list)
    quantize: str = "none"  # none | nf4: the base's block linears in 4-bit NF4 (QLoRA, families/qlora.py)
    adapter: Optional[str] = None  # PEFT folder to start from: r/lora_alpha/layers must equal rank/alpha/targets

    @property
    def on(self) -> bool:
        return self.rank is not None


@dataclass
class ModelConfig:
    name: str = "tiny"  # preset name, for logs and run names
    arch: str = "llama"  # the family (trainer/models/families/): llama, qwen3, hf, vit, hf_vision, timm
    dim: int = 128
    n_layers: int = 4
    n_heads: int = 4
    n_kv_heads: int = 2
    # Width of one head; null: dim / n_heads (Qwen3-32B: dim 5120, 64 heads of 128).
    head_dim: Optional[int] = None
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
    # The attention kernel (trainer/models/families/attention_backend.py): auto (torch's choice,
    # predicted and counted by the planner), flash, cudnn, efficient or math.
    attention: str = "auto"
    # Parameters to freeze (not trained, no optimizer state): globs over parameter names as the
    # model names them, e.g. ["hf.model.embed_tokens.*", "hf.model.layers.[0-5].*"].
    freeze: List[str] = field(default_factory=list)
    # arch=vit (image classification; dim, n_layers, n_heads, ffn_hidden, dropout apply too):
    # square images of image_size pixels cut into patch_size patches. model.path may name a
    # `python -m trainer.export` folder of a ViT to fine-tune (another image size: positions
    # are resized; another num_classes: a new head).
    image_size: int = 224
    patch_size: int = 16
    channels: int = 3
    num_classes: int = 10
    # arch=timm (image classification through timm): `name` is the timm model name or
    # local-dir:<folder>; timm_args are more timm.create_model arguments ({embed_dim: 64, ...});
    # checkpoint_path a local .safetensors/.pth file of pretrained weights (nothing downloaded).
    checkpoint_path: Optional[str] = None
    timm_args: Optional[Any] = None
    lora: LoraSettings = field(default_factory=LoraSettings)


@dataclass
class DataConfig:
    # bytes | tokens | synthetic | text | chat (language models); images | synthetic_images
    source: str = "bytes"
    seq_len: int = 256
    # tokens: the .bin files; images: folders of <class>/<image> (the same classes in both)
    train_path: Optional[str] = None
    val_path: Optional[str] = None
    token_dtype: str = "uint16"
    max_corpus_bytes: int = 32 * 1024 * 1024
    # data=images: random-resized crops and mirroring of training images (true in images.yaml)
    augment: bool = False
    # data=images: an unreadable or corrupt image stops the run naming the file; true skips it
    # instead (the next readable image of the folder takes its place; each is logged once).
    skip_bad_images: bool = False
    # Threads reading the next batches while a step computes (each reads one whole batch);
    # 0 reads each batch in the training thread when its step starts.
    workers: int = 2
    # data=text / chat: the documents (a jsonl or parquet file, a folder or glob of them, a
    # folder saved by `datasets`, or a dataset name), validation from data.val_path or else
    # data.val_fraction of the documents held out; tokenized with data.tokenizer (default:
    # model.path), packed and cached under data.cache_dir (default ~/.cache/blocktrain/data).
    path: Optional[str] = None
    split: str = "train"
    tokenizer: Optional[str] = None
    text_field: str = "text"
    messages_field: str = "messages"
    prompt_field: str = "prompt"
    completion_field: str = "completion"
    # data=chat: the record shape: auto (each record's own) | messages | sharegpt | alpaca |
    # prompt_completion (trainer/data/formats.py)
    format: str = "auto"
    train_on: str = "assistant"  # data=chat: assistant | last | all
    packing: bool = True  # documents share windows (attention never crosses one)
    overlong: str = "truncate"  # data=chat: a conversation longer than seq_len: truncate | drop
    val_fraction: float = 0.01
    cache_dir: Optional[str] = None
    # Read data.path as a stream, tokenized and packed as it arrives (no cache): for corpora
    # larger than the disk. Needs data.val_path; resumes only on the same number of ranks.
    streaming: bool = False
    # data=text / chat: a resume whose training windows differ from those the checkpoint was
    # trained on (a file grew, another tokenizer or setting): refuse (one line saying what
    # changed) | new_epoch (go on with a new window order from that step, logged and written
    # to the run directory's data_changes.json).
    on_change: str = "refuse"
    # data=text / chat: a jsonl line that is not a JSON object, a record in no known shape, or
    # one the chat template fails on stops the run naming it (file and line or index); true
    # skips it instead, counted in the log and in the cache's meta.json (bad_records).
    skip_bad_records: bool = False
    # data=text / chat: processes tokenizing on the node that prepares the cache (datasets'
    # map(num_proc)); null: the cores this process may use split across the node's ranks.
    # The cache is the same whatever the number.
    num_proc: Optional[int] = None


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
    # Sequences per forward on each rank; `auto` (with global_batch_size) picks the one with the
    # least predicted step time that fits train.memory_gib (see trainer/preflight/auto_plan.py).
    micro_batch_size: Any = 16
    grad_accum: int = 1
    # When set, grad_accum is derived: global_batch_size / (micro_batch_size * data-parallel size).
    global_batch_size: Optional[int] = None
    # The memory one rank may use, for checkpointing=auto and micro_batch_size=auto. null: on CUDA
    # the device's total minus memory_reserve_gib; on CPU there is no default.
    memory_gib: Optional[float] = None
    # Left out of a CUDA device's total when memory_gib is null: the CUDA context, NCCL buffers
    # and the allocator's fragmentation, which the memory model does not count.
    memory_reserve_gib: float = 4.0
    # Left out of each node's host memory for what no model here counts (the OS, a process per
    # rank, page cache, checkpoint staging) when pinned memory is judged (trainer.report
    # --host-memory-gib, and the trainer at start). null: 10% of the node.
    host_reserve_gib: Optional[float] = None
    eval_every: int = 50
    # Also evaluate before the first step of a fresh run (a baseline val_loss at step 0). Off by
    # default: it is eval_batches forwards more before training starts, on every fresh start.
    eval_at_start: bool = False
    eval_batches: int = 4
    run_name: Optional[str] = None
    out_dir: str = "outputs"
    device: str = "auto"  # auto | cpu | cuda
    compile: bool = False  # torch.compile each block (after its checkpoint wrapper)
    # torch.compile backend: inductor (generated kernels), aot_eager (traced, no codegen: for
    # checking a setup quickly), eager (dynamo capture only).
    compile_backend: str = "inductor"
    # CPU runs: glibc's mmap and trim thresholds fixed at the highest values its moving ones
    # reach (steady), so a step's memory is reused and not faulted in again every step; glibc:
    # leave them moving with the process's history (offload/heap.py). MALLOC_* set wins.
    cpu_heap: str = "steady"
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
    # Ulysses (sharding/sequence.py): N adjacent ranks share each sample, 1/N of its tokens each,
    # attention trading tokens for heads; auto: the planner picks the smallest N that fits. The
    # ring (sharding/ring.py): M such groups share it too, K/V blocks going round the ring.
    sequence: Any = 1
    context: int = 1


@dataclass
class CheckpointingConfig:
    # none | full | every_k | sqrt | selective | budget | auto (the fastest plan that fits
    # train.memory_gib) | file (plan_file) | compiler (torch.compile's partitioner places
    # recompute under budget; needs train.compile=true)
    policy: str = "none"
    every: int = 2  # every_k: recompute every k-th block
    # selective: aten ops whose outputs are kept (matmuls, attention); the rest is recomputed.
    save_ops: List[str] = field(default_factory=lambda: list(DEFAULT_SAVE_OPS))
    # budget, compiler: activation bytes per rank for the whole step (> 1), or a fraction
    # (<= 1) of the activation bytes without checkpointing.
    budget: Optional[float] = None
    profile_repeats: int = 3  # timing repeats per option when profiling a block
    # full, selective, every_k, sqrt: also time every block's options at start (seconds per
    # option in the plan table, the recompute_s metric). Off, they start without the timing
    # runs, which they do not need; budget, compiler and auto always time (they plan with it).
    profile: bool = False
    # file: the per-block plan of an earlier run (its plan.json), carried out as it is.
    plan_file: Optional[str] = None
    # The loss head of language models: plain (logits, then cross-entropy) or chunked (one
    # fused op, checkpointing/head.py: a chunk of tokens' logits at a time, gradients made in
    # the forward). head_chunk_tokens null: as many tokens as head_budget_mib of fp32 logits hold.
    head: str = "plain"
    head_chunk_tokens: Optional[int] = None
    head_budget_mib: int = 256
    # Which positions the head computes logits for: supervised (only those whose target is
    # learned, gathered before the final norm, for packed text/chat data: head FLOPs and memory
    # scale with the supervised tokens; equal to all within rounding, see checkpointing/head.py)
    # or all (every position: the numerics of runs before 2026-12-03, bit for bit).
    head_rows: str = "supervised"
    # The supervised share of the head's rows in the busiest micro-batch, for the memory model,
    # the report and auto (a run gathers what each batch holds). null: the busiest window's
    # share in the prepared data=text/chat cache when there is one, else 1 (every row).
    head_supervised_fraction: Optional[float] = None
    # Sequence tiles: each block's MLP computed and recomputed over this many slices of the
    # sequence, so its [tokens, ffn] intermediates never exist whole (checkpointing/tiles.py);
    # auto: the planner picks the fewest that fit. 1: untiled.
    tiles: Any = 1


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
    # Count the live tensor bytes (parameters, gradients, optimizer state, activations) of this
    # optimizer step and log them as live_peak_bytes: the quantity the memory model predicts,
    # also on CPU where the process peak includes the interpreter. Slows that one step.
    live_bytes_step: Optional[int] = None
    # Alerts (trainer/observe/watch.py): console/train.log `ALERT` lines, metrics.jsonl events, W&B.
    alert_interval_s: float = 300.0  # at most one alert of a kind per this many seconds
    # tokens/s below this fraction of the running median of the last window steps: drift
    # (0 turns it off)
    alert_throughput_fraction: float = 0.5
    alert_throughput_window: int = 20
    alert_memory_margin: float = 0.1  # measured peak above the predicted one by more than this
    wandb_checkpoint_refs: bool = False  # the last checkpoint as a W&B artifact, by reference


@dataclass
class SaveConfig:
    """Training-state checkpoints (model, optimizer, schedule, data position, RNG): trainer/state/checkpoint.py."""

    every: int = 100  # save after every N optimizer steps; 0: only at the end and on preemption
    keep: int = 2  # committed checkpoints kept; older ones go once a newer one is committed
    async_save: bool = False  # write in a thread after copying the state to CPU memory
    at_end: bool = True  # also save after the last step
    resume: bool = True  # a run starting in a folder with checkpoints continues from the newest
    dir: Optional[str] = None  # null = <run dir>/checkpoints
    signal: Optional[str] = "SIGUSR1"  # besides SIGTERM: finish the step, save, exit
    # Exit status after a preemption save (75, EX_TEMPFAIL: run me again). 0 exits cleanly and
    # leaves the stop marker (preempted.json) to say it: the Slurm job script's choice, so that
    # torchrun and srun report no failure for a requeue the job asked for.
    preempt_exit_code: int = 75


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
    inject_slow_at: List[int] = field(default_factory=list)  # every rank sleeps inject_slow_s
    inject_slow_s: float = 0.5


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


def tile_count(c: CheckpointingConfig) -> int:
    """checkpointing.tiles as a number (`auto` before auto has chosen: 1)."""
    return 1 if c.tiles in (None, "auto") else int(c.tiles)


def register_schema() -> None:
    ConfigStore.instance().store(name="schema", node=Config)


DTYPES = ("float32", "bfloat16", "float16")
# model.arch's choices are the model families' (trainer/models/families/), data.source's the
# sources' (trainer/data/factory.py): each refuses others.
CHOICES = {
    "data.train_on": ("assistant", "last", "all"),
    "data.format": ("auto", "messages", "sharegpt", "alpaca", "prompt_completion"),
    "checkpointing.head": ("plain", "chunked"),
    "checkpointing.head_rows": ("supervised", "all"),
    "data.overlong": ("truncate", "drop"),
    "data.on_change": ("refuse", "new_epoch"),
    "data.token_dtype": ("uint16", "uint32"),
    "train.device": ("auto", "cpu", "cuda"),
    "train.compile_backend": ("inductor", "aot_eager", "eager"),
    "train.cpu_heap": ("steady", "glibc"),
    "sharding.mode": ("fsdp", "hsdp", "none"),
    "checkpointing.policy": ("none", "full", "every_k", "sqrt", "selective", "budget", "auto",
                             "file", "compiler"),
    "offload.target": ("none", "cpu", "disk"),
    "model.attention": ("auto", "flash", "cudnn", "efficient", "math"),
    "model.lora.quantize": ("none", "nf4"),
}


# Signals a launcher may send ahead of a time limit (SIGTERM is always handled).
SIGNALS = ("SIGUSR1", "SIGUSR2", "SIGINT", "SIGHUP", "SIGTERM")
