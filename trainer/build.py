"""Composing the model: build on meta, find blocks, plan, wrap per block, shard, materialise.

Nothing here is specific to a model: its family (trainer/models/families/) builds it on meta,
finds its blocks and counts its FLOPs; the model contributes `init_param(name, full, generator)`
(optional: a generic fallback covers plain modules).
"""

from __future__ import annotations

import fnmatch
import hashlib
import logging
import time
from dataclasses import asdict, dataclass, replace
from typing import Callable, Optional, Sequence

import torch
from torch import nn
from torch.distributed.tensor import DTensor, Shard

import torch.distributed as dist

from checkpointing.blocks import canonical_name
from checkpointing.compiled import compile_blocks
from checkpointing.planner.metatrace import cast_like_fsdp
from checkpointing.plan import BlockPlan, with_offload, with_tiles
from checkpointing.tiles import apply_tiles
from checkpointing.planner.policies import (Budget, BudgetError, OffloadCost, choose_plan,
                                   compiler_budgets, resolve_budget)
from checkpointing.planner.profile import (BlockProfile, profile_blocks, trace_on_meta,
                                  with_compiler_option)
from checkpointing.meter import SavedBytesMeter
from checkpointing.wrap import apply_checkpointing, resolve_ops
from trainer.distenv import DistEnv
from offload.apply import apply_offload, build_offloader, offload_dir, remove_stale_offload
from offload.bandwidth import seconds_per_byte
from offload.engine import Offloader
from sharding import fsdp
from sharding.fsdp import DTYPES
from trainer.config import CheckpointingConfig, Config, ConfigError, ModelConfig
from trainer.models.families.attention_backend import apply_attention
from trainer.models.families.attention_backend import resolve as resolve_attention
from trainer.models.families import family_of
from trainer.models.families.lora import seed_name
from trainer.task import task_for
from sharding.layout import Layout

log = logging.getLogger("trainer")
# Policies whose plan follows from the block count alone: timing the blocks is optional.
FIXED_POLICIES = ("full", "selective", "every_k", "sqrt")


def init_params(model: nn.Module, seed: int) -> None:
    """Initialise an unsharded, materialised model exactly as `materialize` would."""
    materialize(model, next(model.parameters()).device, seed, allocate=False)


def build_on_meta(cfg: ModelConfig) -> nn.Module:
    """The model of `model.arch`, parameters on the meta device; with model.lora, its adapters
    too (PEFT, on meta: the blocks fully_shard gets hold the frozen base and the adapters)."""
    model = family_of(cfg).build_on_meta(cfg)
    if cfg.lora.on:
        from trainer.models.families.lora import apply_lora

        names, _ = find_model_blocks(model, cfg)
        family = family_of(cfg)
        apply_lora(model, cfg.lora, names, getattr(model, "init_param", None) or default_init,
                   lambda name, tensor: family.adapter_tensor(name, tensor, asdict(cfg)))
    return model


def lora_base_dtype(cfg: Config) -> Optional[torch.dtype]:
    """LoRA's frozen base is stored in sharding.param_dtype (no master copy: it never steps);
    None where there is nothing to change (no LoRA, no mixed precision)."""
    s = cfg.sharding
    if not cfg.model.lora.on or s.mode == "none" or not s.param_dtype:
        return None
    return DTYPES[s.param_dtype]


def build_run_model(cfg: Config) -> nn.Module:
    """The meta model as this run stores it: build_on_meta, LoRA's base in its dtype."""
    model = build_on_meta(cfg.model)
    dtype = lora_base_dtype(cfg)
    if dtype is not None:
        from trainer.models.families.lora import store_base_in

        store_base_in(model, dtype)
    return model


def freeze(model: nn.Module, patterns: Sequence[str]) -> int:
    """requires_grad=False for parameters whose name matches a glob; returns how many. Before
    sharding, so FSDP keeps each one's flag; the optimizer only sees trainable parameters."""
    if not patterns:
        return 0
    names = [name for name, _ in model.named_parameters()]
    for pattern in patterns:
        if not any(fnmatch.fnmatchcase(name, pattern) for name in names):
            raise ConfigError("model.freeze", f"{pattern!r} matches no parameter; names look "
                              f"like {', '.join(names[:3])}")
    frozen = 0
    for name, param in model.named_parameters():
        if any(fnmatch.fnmatchcase(name, pattern) for pattern in patterns):
            param.requires_grad_(False)
            frozen += 1
    if not any(p.requires_grad for p in model.parameters()):
        raise ConfigError("model.freeze", "freezes every parameter; nothing would train")
    return frozen


def default_init(name: str, full: torch.Tensor, generator: torch.Generator) -> None:
    """For models without `init_param`: N(0, 0.02) matrices, unit norms/scales, zero biases."""
    if full.ndim >= 2:
        full.normal_(0.0, 0.02, generator=generator)
    elif name.endswith("bias"):
        full.zero_()
    else:
        full.fill_(1.0)


def param_seed(seed: int, name: str) -> int:
    """Per-parameter seed, the same on every rank and process (Python's hash() is salted)."""
    digest = hashlib.blake2b(f"{seed}/{name}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & (2**63 - 1)


def _local_part(full: torch.Tensor, param: DTensor) -> torch.Tensor:
    """This rank's piece of `full` under the param's placements (torch.chunk semantics, as FSDP2)."""
    piece = full
    coords = param.device_mesh.get_coordinate()
    for mesh_dim, placement in enumerate(param.placements):
        if isinstance(placement, Shard):
            chunks = torch.chunk(piece, param.device_mesh.size(mesh_dim), dim=placement.dim)
            index = coords[mesh_dim]
            piece = chunks[index] if index < len(chunks) else piece.narrow(placement.dim, 0, 0)
    return piece


@torch.no_grad()
def materialize(model: nn.Module, device: torch.device, seed: int, allocate: bool = True,
                storage: Optional[torch.device] = None) -> None:
    """Allocate real storage and initialise every parameter identically for any world size.

    Each parameter's full value comes from its own generator seeded by (seed, name) on
    `device`, the compute device; a rank keeps only its shard, in `storage` (default: `device`;
    the CPU under FSDP2's CPU offload). So the weights depend neither on how many ranks share
    them nor on where they live: CUDA's and the CPU's generators draw different numbers.
    """
    init_fn: Callable = getattr(model, "init_param", None) or default_init
    if allocate:
        model.to_empty(device=storage or device)
    seen: set[int] = set()
    for name, param in model.named_parameters():
        if id(param) in seen:  # tied weights are initialised once, under their first name
            continue
        seen.add(id(param))
        # An adapted layer's base weight (PEFT's `base_layer`, NF4's parts) is drawn as
        # without adapters (trainer/models/families/lora.py).
        clean = canonical_name(name)
        generator = torch.Generator(device=device).manual_seed(param_seed(seed, seed_name(clean)))
        full = torch.empty(param.shape, dtype=param.dtype, device=device)
        init_fn(clean, full, generator)
        if isinstance(param, DTensor):
            param.to_local().copy_(_local_part(full, param))
        else:
            param.copy_(full)
    if hasattr(model, "reset_buffers"):
        model.reset_buffers()


@dataclass
class Built:
    model: nn.Module
    plan: list[BlockPlan]
    profiles: Optional[list[BlockProfile]]  # when some block recomputes
    rest_saved_bytes: int  # activations kept outside the blocks (from the meta trace)
    budget: Optional[Budget]
    compiled_blocks: int = 0  # blocks whose forward torch.compile replaced
    offloader: Optional[Offloader] = None
    flops_per_token: float = 0.0  # training FLOPs per token, for MFU
    decision: Optional[object] = None  # preflight/auto_plan.py's Decision, when it chose the plan
    build_s: float = 0.0  # seconds build_model took: meta model, profiling (compiling there too)
    started: float = 0.0  # time.perf_counter() when build_model began


def plan_blocks(cfg: Config, model: nn.Module, names: Sequence[str], blocks: Sequence[nn.Module],
                denv: DistEnv, run_dir: str) -> tuple[list[BlockPlan], Optional[list[BlockProfile]], int,
                                        Optional[Budget]]:
    """The per-block plan; profiles blocks (rank 0, shared with all) when recompute is in play."""
    c, shard = cfg.checkpointing, cfg.sharding.mode != "none"
    if c.policy == "none" or (c.policy in FIXED_POLICIES and not c.profile):
        return choose_plan(c.policy, names, shard, c.every), None, 0, None
    if c.policy == "file":
        from trainer.state.planfile import read_plan

        return read_plan(c.plan_file, names, shard, cfg.train.compile), None, 0, None
    payload = [None]
    if denv.rank == 0:
        model, blocks = profiling_model(cfg, model, blocks)
        task = task_for(cfg.model, cfg.data, cfg.checkpointing)
        inputs, targets = task.example(cfg.train.micro_batch_size)
        trace = trace_on_meta(model, blocks, lambda m: task.loss(m, inputs, targets))
        profiles = profile_blocks(blocks, trace, denv.device, resolve_ops(c.save_ops),
                                  c.profile_repeats,
                                  cfg.train.compile_backend if cfg.train.compile else None)
        if c.policy == "budget":  # working sets from the memory model (the report's)
            profiles = with_working_sets(cfg, model, names, blocks, profiles, denv.device)
        if c.policy == "budget" and cfg.train.compile:  # the compiler's placement, an option too
            profiles = _with_compiler_option(cfg, blocks, trace, profiles, denv.device)
        payload = [(profiles, trace.rest_saved_bytes)]
    if dist.is_initialized() and dist.get_world_size() > 1:
        # Timings differ between ranks; every rank must carry out the same plan.
        dist.broadcast_object_list(payload, src=0)
    profiles, rest = payload[0]
    budget, offload = None, None
    if c.policy in ("budget", "compiler"):
        budget = resolve_budget(c.budget, profiles, rest)
    if c.policy == "budget":
        offload = _offload_cost(cfg, denv, run_dir)
    plan = choose_plan(c.policy, names, shard, c.every, profiles, rest, budget, offload)
    return plan, profiles, rest, budget


def profiling_model(cfg: Config, model: nn.Module, blocks: Sequence[nn.Module]
                    ) -> tuple[nn.Module, Sequence[nn.Module]]:
    """The meta model profiling measures: under FSDP mixed precision a copy computing in
    `sharding.param_dtype`, as FSDP will run it. Profiling the fp32 model instead measures
    other kernels and twice the bytes, and fp32 attention with grouped-query heads takes the
    math path (whole [batch, heads, seq, seq] score tensors: tens of GiB at long sequences)."""
    s = cfg.sharding
    dtype = DTYPES.get(s.param_dtype) if s.mode != "none" and s.param_dtype else None
    if dtype is None or dtype == next(model.parameters()).dtype:
        return model, blocks
    copy = build_on_meta(cfg.model)  # the run's own model stays in fp32 (FSDP's master weights)
    freeze(copy, cfg.model.freeze)
    _, copy_blocks = find_model_blocks(copy, cfg.model)
    cast_like_fsdp(copy, copy_blocks, dtype)
    return copy, copy_blocks


def _with_compiler_option(cfg: Config, blocks: Sequence[nn.Module], trace,
                          profiles: list[BlockProfile], device: torch.device
                          ) -> list[BlockProfile]:
    """Under compile the planner may also choose the compiler's own placement for a block, at
    the activation_memory_budget checkpointing=compiler would use for the same budget."""
    budget = resolve_budget(cfg.checkpointing.budget, profiles, trace.rest_saved_bytes)
    try:
        budgets = compiler_budgets(profiles, budget, trace.rest_saved_bytes)
    except BudgetError:  # below even the compiler's least: the planner's own error says more
        budgets = [0.0] * len(profiles)
    return with_compiler_option(blocks, trace, device, profiles, budgets,
                                cfg.train.compile_backend, cfg.checkpointing.profile_repeats)


def with_working_sets(cfg: Config, model: nn.Module, names: Sequence[str],
                      blocks: Sequence[nn.Module], profiles: list[BlockProfile],
                      device: torch.device) -> list[BlockProfile]:
    """Each profile with its block's working set per option, measured on meta by the memory
    model (checkpointing/planner/metatrace.py), for the planner's K."""
    from checkpointing.planner.metatrace import profile_on_meta

    c = cfg.checkpointing
    task = task_for(cfg.model, cfg.data, c)
    inputs, targets = task.example(cfg.train.micro_batch_size)
    meta = profile_on_meta(model, names, blocks, lambda m: task.loss(m, inputs, targets),
                           resolve_ops(c.save_ops), list(c.save_ops),
                           like_cpu=device.type == "cpu",
                           attention=resolve_attention(cfg, device.type)[0])
    return [replace(p, working_bytes=dict(m.peak_bytes)) for p, m in zip(profiles, meta.blocks)]


def _offload_cost(cfg: Config, denv: DistEnv, run_dir: str) -> Optional[OffloadCost]:
    """The planner's offload option, costed from bandwidth measured on rank 0 and shared."""
    o = cfg.offload
    if o.target == "none" or (o.target == "cpu" and denv.device.type == "cpu"):
        return None  # nothing to move, so no device memory to win: not an option to plan with
    payload = [None]
    if denv.rank == 0:
        payload = [seconds_per_byte(o.target, denv.device,
                                    offload_dir(o.dir, run_dir, denv.rank))]
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.broadcast_object_list(payload, src=0)
    return OffloadCost(o.target, payload[0], o.min_bytes, o.keep_last)


def build_model(cfg: Config, denv: DistEnv, layout: Layout, meter: SavedBytesMeter,
                run_dir: Optional[str] = None,
                decided: Optional[tuple[list[BlockPlan], Optional[list[BlockProfile]]]] = None
                ) -> Built:
    """Meta model -> blocks -> plan -> per block: checkpoint, offload hooks, compile, shard ->
    root -> real. layout: the run's (validation's, or auto's once it chose); decided: the plan
    (and its profiles) checkpointing=auto chose."""
    started = time.perf_counter()
    model = build_run_model(cfg)
    flops = family_of(cfg.model).flops_per_token(
        cfg.model, model, task_for(cfg.model, cfg.data, cfg.checkpointing).tokens_per_sample)
    freeze(model, cfg.model.freeze)
    names, blocks = find_model_blocks(model, cfg.model)
    run_dir = run_dir or cfg.train.out_dir
    o = cfg.offload
    if decided is not None:
        plan, profiles = decided
        rest, budget = 0, None
    else:
        plan, profiles, rest, budget = plan_blocks(cfg, model, names, blocks, denv, run_dir)
    if cfg.checkpointing.policy not in ("budget", "auto", "file"):  # those decided offload
        plan = with_offload(plan, o.target, o.keep_last)
    plan = run_tiles(plan, cfg.checkpointing, decided is not None)
    # Tiles first: the blocks' tiled forward is what the checkpoint wrapper recomputes.
    family = family_of(cfg.model)
    apply_tiles(blocks, plan, family.tile_block)
    head_tiles = max((p.tiles for p in plan), default=1)
    if head_tiles > 1:
        family.tile_head(model, head_tiles)
    # Order matters: the checkpoint wrapper, then compile (the checkpoint is traced into the
    # graph), then the offload hooks (which see what the block keeps: its inputs if it
    # recomputes, whatever the compiled backward keeps if compiled), and all of it inside
    # fully_shard, so recompute happens while FSDP holds the block unsharded (one all-gather).
    # Compiled, selective checkpointing's cache is saved tensors the meter's hooks see.
    apply_checkpointing(blocks, plan, cfg.checkpointing.save_ops,
                        meter=None if cfg.train.compile else meter)
    compiled = (compile_blocks(blocks, plan, cfg.train.compile_backend)
                if cfg.train.compile else 0)
    if denv.local_rank == 0:  # this host's leftovers of any earlier start, kill -9 included
        removed = remove_stale_offload(o.dir, run_dir, denv.world_size)
        if removed:
            log.warning("removed the offload files of processes that ended without removing "
                        "them: %s", ", ".join(removed))
    offloader = build_offloader(o.target, denv.device, o.min_bytes, o.max_host_bytes,
                                offload_dir(o.dir, run_dir, denv.rank),
                                o.max_inflight_bytes, denv.is_main, o.trim_heap)
    apply_offload(blocks, plan, offloader, meter)
    cpu_offload = cfg.sharding.cpu_offload and denv.device.type != "cpu"
    if cfg.sharding.cpu_offload and not cpu_offload and denv.is_main:
        log.warning("sharding.cpu_offload=true: the compute device is the CPU, so parameters, "
                    "gradients and optimizer state already live in CPU memory; nothing to move")
    # The kernel choice is the innermost wrap of attention; Ulysses' all-to-alls go around it
    # (under sharding.context the ring replaces the kernel: it runs its own, sharding/ring.py).
    apply_attention(cfg, model, denv.device, denv.is_main)
    mesh, group, ring = sharding_mesh(layout, denv)
    if group is not None or ring is not None:  # attention runs over the whole samples
        family_of(cfg.model).sequence_parallel(model, group, ring)
    if mesh is not None:
        fsdp.apply_fsdp(model, blocks, plan, mesh, fsdp.mixed_precision(
            cfg.sharding.param_dtype, cfg.sharding.reduce_dtype),
            cfg.sharding.reshard_after_forward, cpu_offload)
    # With FSDP2 CPU offload the sharded parameters are born in CPU memory (their values are
    # still drawn on the device, as a device-resident run draws them).
    materialize(model, denv.device, cfg.train.seed,
                storage=torch.device("cpu") if cpu_offload else None)
    if mesh is None and denv.world_size > 1:
        model = fsdp.apply_ddp(model, denv.device)
    forget_build_peak(denv.device)
    return Built(model, plan, profiles, rest, budget, compiled, offloader, flops,
                 build_s=time.perf_counter() - started, started=started)


def run_tiles(plan: list[BlockPlan], c: CheckpointingConfig,
              decided: bool = False) -> list[BlockPlan]:
    """checkpointing.tiles=N gives every block N tiles; a plan file's, or a plan the planner
    decided (`decided`: checkpointing=auto's), keeps its own."""
    if c.policy == "file" or decided and (c.tiles == "auto" or any(p.tiles > 1 for p in plan)):
        return plan
    if c.tiles == "auto":
        raise ConfigError("checkpointing.tiles", "auto is chosen by the planner before the "
                          "build (checkpointing=auto or train.micro_batch_size=auto); set a "
                          "number of tiles for this policy")
    return with_tiles(plan, c.tiles)


def sharding_mesh(layout: Layout, denv: DistEnv) -> tuple[Optional[object],
                                                          Optional[dist.ProcessGroup],
                                                          Optional[dist.ProcessGroup]]:
    """(the mesh fully_shard gets, the sequence group or None, the ring or None). With
    sequence x context > 1, the mesh of sharding/sequence.py: FSDP still shards over every
    rank, sequence and ring ranks included, and adjacent ranks share each sample, as the
    layout says (the Data reads so)."""
    if layout.share == 1:
        return fsdp.build_mesh(layout, denv.device.type), None, None
    from sharding.sequence import build_sequence_mesh

    seq = build_sequence_mesh(layout, denv.device.type)
    return seq.fsdp, seq.group if layout.degree > 1 else None, seq.context_group


def forget_build_peak(device: torch.device, cuda=torch.cuda) -> None:
    """CUDA: hand the allocator's cached blocks back and restart its peak statistics, so that
    profiling (which runs blocks unsharded, under every option) never reads as the run's peak
    and its cache does not crowd the run. `cuda` stands in for torch.cuda in tests."""
    if device.type == "cuda":
        cuda.empty_cache()
        cuda.reset_peak_memory_stats(device)


def find_model_blocks(model: nn.Module, cfg: ModelConfig) -> tuple[list[str], list[nn.Module]]:
    """(names, modules) of the model's blocks, as its family finds them (model.block_pattern)."""
    found = family_of(cfg).blocks(model, cfg.block_pattern)
    return [name for name, _ in found], [module for _, module in found]
