"""One configuration's predicted per-rank memory: meta profile -> plan -> memory estimate.

A Scenario is a composed config plus its world; `Evaluator` turns it into an `Outcome` and keeps
the meta profiles it made, so configurations that differ only in the plan, the world or the
sharding (not in activation shapes or dtypes) reuse one profile instead of tracing again.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Optional

import torch

from checkpointing.planner.memory import (Estimate, ParamGroup, Setup, as_modelled, estimate,
                                 param_groups)
from checkpointing.planner.metatrace import (FusedAttentionOnMeta, MetaProfile, cast_like_fsdp,
                                             profile_on_meta)
from checkpointing.plan import BlockPlan, make_plan, with_offload, with_tiles
from checkpointing.planner.policies import Budget, OffloadCost, choose_plan, resolve_budget
from checkpointing.planner.profile import BlockProfile
from checkpointing.wrap import resolve_ops
from sharding.fsdp import DTYPES
from sharding.ring import MetaRingExchange
from sharding.sequence import MetaExchange
from trainer.build import build_run_model, find_model_blocks, lora_base_dtype
from trainer.config import Config, tile_count
from trainer.models.families.attention_backend import resolve as resolve_attention
from trainer.models.families import family_of
from sharding.layout import Layout
from trainer.validate import validate
from trainer.task import task_for

# Offload transfer rates where nothing is measured (the report): PCIe 4.0 x16 as it is usually
# reached, and one NVMe drive.
NOMINAL_SECONDS_PER_BYTE = {"cpu": 1 / 20e9, "disk": 1 / 2e9}
# Ulysses' all-to-all, bytes a rank sends per second where nothing is measured: a sequence group
# inside one node (NVLink, as all-to-alls of tens of MiB usually reach on H100/H200 nodes) or
# spread over nodes (one 200 Gb/s network port per GPU). A round figure, not a measurement.
NOMINAL_ALL_TO_ALL_BYTES_PER_S = {"node": 100e9, "network": 20e9}
# sharding.cpu_offload's optimizer step on the host: seconds per trained element of torch's AdamW
# over fp32 CPU tensors too large for the caches, as a large model's shards are (measured
# 2026-12-05, launch/bench/host_adamw.py on a 2-core machine: 4.1 ns with 2 threads, 6.2 with 1;
# its passes read and write ~84 bytes an element, counted). Not the GPU host's: a rank there has its own share of
# that host's cores and memory bandwidth (launch/gpu_check's env stage measures that host's).
NOMINAL_HOST_ADAMW_S_PER_ELEMENT = 4e-9




def one_rank_of_sequence(cfg: Config, model, degree: int, tiles: int
                         ) -> tuple[Optional[MetaExchange], Optional[MetaRingExchange]]:
    """Make a meta model run as one rank does: its blocks' token-wise parts (and the final
    norm, where the family tiles it) in `tiles` sequence tiles; for sharding.context=M > 1,
    attention through the ring with the meta ring (sharding/ring.py's MetaRingExchange: the
    ring's own code, its buffers as allocations); for a degree > 1, Ulysses' wrap around it
    with the meta exchange (sharding/sequence.py's). Returns both stand-ins (None: not used),
    to count what they send."""
    family = family_of(cfg.model)
    if tiles > 1:
        for _, block in family.blocks(model, cfg.model.block_pattern):
            family.tile_block(block, tiles)
        family.tile_head(model, tiles)
    ring = exchange = None
    if cfg.sharding.context > 1:
        ring = MetaRingExchange(cfg.sharding.context)
        family.wrap_ring(model, ring)
    if degree > 1:
        exchange = MetaExchange(degree)
        family.wrap_ulysses(model, exchange)
    return exchange, ring


def rank_share(cfg: Config, degree: int) -> int:
    """Ranks sharing each sample: the sequence degree x sharding.context."""
    return degree * cfg.sharding.context


@dataclass(frozen=True)
class Scenario:
    cfg: Config
    layout: Layout
    gpus_per_node: int


@dataclass(frozen=True)
class Outcome:
    scenario: Scenario
    plan: list[BlockPlan]
    estimate: Estimate
    profile: MetaProfile
    groups: list[ParamGroup]
    budget: Optional[Budget]
    seconds_per_flop: float  # 1 / nominal throughput, for recompute seconds
    setup: Optional[Setup] = None  # what the estimate was made for


def with_changes(scenario: Scenario, world_size: Optional[int] = None, nodes: Optional[int] = None,
                 **sections: dict) -> Scenario:
    """A copy with config sections changed (e.g. train={"micro_batch_size": 2}) and, when given,
    a new world; the layout is re-derived by the trainer's own validation."""
    cfg = scenario.cfg
    for section, values in sections.items():
        cfg = dataclasses.replace(cfg, **{section: dataclasses.replace(getattr(cfg, section),
                                                                       **values)})
    world = world_size or scenario.layout.world_size
    num_nodes = nodes or max(1, scenario.layout.world_size // scenario.gpus_per_node)
    layout = validate(cfg, world_size=world, num_nodes=num_nodes)
    return Scenario(cfg, layout, world // num_nodes)


def device_type_of(cfg: Config) -> str:
    """The device a prediction is for: the run's own on CPU, else a GPU (the report's purpose)."""
    return "cpu" if cfg.train.device == "cpu" else "cuda"


def setup_of(scenario: Scenario, orig_dtype: torch.dtype, optimizer_foreach: bool,
             device_type: str = "cuda") -> Setup:
    s, o = scenario.cfg.sharding, scenario.cfg.offload
    param_dtype = DTYPES[s.param_dtype] if s.param_dtype else orig_dtype
    # Offload moves data except to the CPU from the CPU (offload/apply.py keeps them in place).
    moves = o.target == "disk" or (o.target == "cpu" and device_type == "cuda")
    return Setup(mode=s.mode, world_size=scenario.layout.world_size, shard=scenario.layout.shard,
                 grad_accum=scenario.layout.grad_accum, param_dtype=param_dtype,
                 orig_dtype=orig_dtype,
                 reduce_dtype=DTYPES[s.reduce_dtype] if s.reduce_dtype else param_dtype,
                 reshard_after_forward=s.reshard_after_forward,
                 optimizer_foreach=optimizer_foreach,
                 cpu_offload=s.cpu_offload and device_type == "cuda",
                 offload_min_bytes=o.min_bytes if moves else None,
                 offload_target=o.target)


def block_profiles(profile: MetaProfile, seconds_per_flop: float) -> list[BlockProfile]:
    """The planner's inputs as the trainer builds them, with recompute time from FLOPs."""
    return [BlockProfile(saved_bytes=dict(m.saved_bytes),
                         cost_s={o: f * seconds_per_flop for o, f in m.recompute_flops.items()},
                         compute_s=(3 * m.forward_flops - m.frozen_flops) * seconds_per_flop,
                         storage_sizes=dict(m.storage_sizes), working_bytes=dict(m.peak_bytes))
            for m in profile.blocks]


def trainer_plan(scenario: Scenario, profile: MetaProfile,
              seconds_per_flop: float) -> tuple[list[BlockPlan], Optional[Budget]]:
    """The trainer's plan for this config (policies.choose_plan); raises BudgetError."""
    c = scenario.cfg.checkpointing
    shard = scenario.cfg.sharding.mode != "none"
    names, o = list(profile.block_names), scenario.cfg.offload
    if c.policy == "file":
        from trainer.state.planfile import read_plan

        return read_plan(c.plan_file, names, shard, scenario.cfg.train.compile), None
    assert c.policy != "auto", "checkpointing=auto plans through trainer/preflight/auto_plan.py"
    if c.policy == "compiler":  # decided inside the compiled graph; evaluate() bounds it
        plan = make_plan(names, ["compiler"] * len(names), shard)
        return with_offload(plan, o.target, o.keep_last), None
    profiles = block_profiles(profile, seconds_per_flop)
    budget, offload = None, None
    if c.policy == "budget":
        budget = resolve_budget(c.budget, profiles, profile.rest_bytes)
        if o.target == "disk" or (o.target == "cpu" and device_type_of(scenario.cfg) == "cuda"):
            # Not measured here: a nominal rate (above), where the trainer would measure one.

            offload = OffloadCost(o.target, NOMINAL_SECONDS_PER_BYTE[o.target], o.min_bytes,
                                  o.keep_last)
    plan = choose_plan(c.policy, names, shard, c.every, profiles, profile.rest_bytes, budget,
                       offload)
    if c.policy != "budget":  # as trainer/build.py does
        plan = with_offload(plan, o.target, o.keep_last)
    return with_tiles(plan, tile_count(scenario.cfg.checkpointing)), budget


class Evaluator:
    """Predicts scenarios, tracing each distinct activation shape on meta only once."""

    def __init__(self, tflops: float, optimizer_foreach: bool = True,
                 device_type: Optional[str] = None) -> None:
        self.seconds_per_flop = 1.0 / (tflops * 1e12)
        self.optimizer_foreach = optimizer_foreach
        # cpu: attention as the CPU runs it (metatrace.py); cuda: a GPU's kernels, their
        # backward workspace included (attention_workspace.py); None: a GPU's kernels' own
        # bytes without it, which a CPU step's flash kernel keeps too (the CPU comparisons).
        self.device_type = device_type or "cuda"
        self.gpu_workspace = device_type == "cuda"
        self._profiles: dict[tuple, tuple[MetaProfile, list[ParamGroup], torch.dtype]] = {}

    def profile(self, cfg: Config, degree: int = 1
                ) -> tuple[MetaProfile, list[ParamGroup], torch.dtype]:
        """Meta profile, parameter groups and parameter dtype of a config (cached by shapes).

        One rank's: with a sequence degree N (the scenario's layout's) and sharding.context M
        its T/(N M) tokens, attention between the meta stand-ins of Ulysses' all-to-alls
        (sharding/sequence.py's MetaExchange) and through the ring's own code with a meta ring
        (sharding/ring.py's MetaRingExchange); with
        checkpointing.tiles=n every block's MLP tiled as the trainer tiles it."""
        task = task_for(cfg.model, cfg.data, cfg.checkpointing)
        tiles = tile_count(cfg.checkpointing)
        key = (repr(cfg.model), cfg.train.micro_batch_size, cfg.data.seq_len,
               cfg.sharding.param_dtype if cfg.sharding.mode != "none" else None,
               tuple(cfg.checkpointing.save_ops), task.head_chunk, task.gather_rows,
               task.meta_fraction, degree, cfg.sharding.context, tiles, self.attention(cfg),
               lora_base_dtype(cfg))
        if key not in self._profiles:
            model = build_run_model(cfg)
            names, blocks = find_model_blocks(model, cfg.model)
            # The trained parameters' dtype (LoRA's frozen base may be stored in another).
            orig_dtype = next((p.dtype for p in model.parameters() if p.requires_grad),
                              next(model.parameters()).dtype)
            groups = param_groups(model, blocks, names)
            if key[3] is not None and DTYPES[key[3]] != orig_dtype:
                cast_like_fsdp(model, blocks, DTYPES[key[3]])
            exchange, ring = one_rank_of_sequence(cfg, model, degree, tiles)
            inputs, targets = task.example(cfg.train.micro_batch_size)
            share = rank_share(cfg, degree)
            if share > 1:  # this rank's share of each row (a language model's tokens)
                inputs, targets = (t[:, :t.shape[1] // share] for t in (inputs, targets))
            names_ops = list(cfg.checkpointing.save_ops)
            profile = profile_on_meta(model, names, blocks,
                                      lambda m: task.loss(m, inputs, targets),
                                      resolve_ops(names_ops), names_ops,
                                      like_cpu=self.device_type == "cpu",
                                      attention=self.attention(cfg))
            if exchange is not None or ring is not None:
                profile = self._count_sent(profile, task, model, inputs, targets, exchange,
                                           ring, len(blocks))
            self._profiles[key] = (profile, groups, orig_dtype)
        return self._profiles[key]

    def attention(self, cfg: Config) -> Optional[str]:
        """The GPU attention kernel whose workspace this prediction counts (model.attention,
        auto predicted), or None."""
        return resolve_attention(cfg, "cuda")[0] if self.gpu_workspace else None

    def _count_sent(self, profile: MetaProfile, task, model, inputs, targets,
                    exchange: Optional[MetaExchange], ring: Optional[MetaRingExchange],
                    blocks: int) -> MetaProfile:
        """One forward's all-to-alls and ring sends, counted alone; the ring's backward sends
        from that forward's backward (one pass, not a second forward: 53 -> 46 s for README's
        25M-token ring report)."""
        for stand_in in (exchange, ring):
            if stand_in is not None:
                stand_in.sent_bytes = 0
        blocks = max(1, blocks)
        with FusedAttentionOnMeta(self.device_type == "cpu"):
            with torch.set_grad_enabled(ring is not None):  # only the ring's backward sends
                loss = task.loss(model, inputs, targets)
            sent = {"sent_bytes_per_block": 0 if exchange is None
                    else exchange.sent_bytes // blocks}
            if ring is not None:
                forward, ring.sent_bytes = ring.sent_bytes, 0
                loss.backward()
                model.zero_grad(set_to_none=True)
                sent.update(ring_sent_bytes_per_block=forward // blocks,
                            ring_backward_bytes_per_block=ring.sent_bytes // blocks)
        return dataclasses.replace(profile, **sent)

    def setup(self, scenario: Scenario) -> Setup:
        return setup_of(scenario, self.profile(scenario.cfg, scenario.layout.degree)[2],
                        self.optimizer_foreach, self.device_type)

    def evaluate(self, scenario: Scenario, plan: Optional[list[BlockPlan]] = None) -> Outcome:
        """The prediction of the trainer's plan for this config, or of `plan` when given."""
        profile, groups, orig_dtype = self.profile(scenario.cfg, scenario.layout.degree)
        budget = None
        if plan is None:
            plan, budget = trainer_plan(scenario, profile, self.seconds_per_flop)
        plan = as_modelled(plan)  # what the tables and the picture show is what was estimated
        setup = self.setup(scenario)
        return Outcome(scenario, plan, estimate(groups, profile, plan, setup), profile, groups,
                       budget, self.seconds_per_flop, setup)
