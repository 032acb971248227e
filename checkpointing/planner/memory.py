"""Per-rank memory of one training step, from parameter shapes and the meta activation profile.

Every term is counted in bytes from shapes and dtypes, following what FSDP2 (torch 2.13) and
AdamW allocate; nothing is fitted. The step is a sequence of phases and the predicted peak is the
largest phase, each phase being the sum of what is alive during it:

  persistent  sharded parameters (original dtype: each parameter's dim 0 padded to a multiple of
              the shard group and split); AdamW's exp_avg and exp_avg_sq (2 x the parameters);
              sharded gradients (original dtype), but only those already reduced at that moment:
              with one micro-batch a block's gradient appears when its backward ends; with
              grad_accum > 1 all exist from the first micro-batch on. DDP (sharding=none on
              several ranks) adds its gradient buckets (one more copy of the gradients).
  unsharded   in param_dtype: the root group (everything outside the blocks) stays unsharded from
              its forward to the end of backward; the running block's parameters, plus the next
              block's all-gather buffer when there is more than one shard (prefetch); one block's
              reduce-scatter input (reduce_dtype, padded); the unsharded gradients of root
              parameters the head uses, from the head's backward to the root's reduce-scatter.
              With reshard_after_forward=false every block up to the running one stays unsharded.
  activations the chain formula of checkpointing.planner.search.activation_peak over the embedding
              stage, the blocks and the head: max(S_total, max_i (S_<i + K_i)), with S the saved
              bytes of the plan's options and K the measured working set of each block (its
              saved bytes, recompute, gradients and its unsharded weight gradients) and of the
              head (logits, their fp32 copy and gradients).

Not counted: the CUDA context, NCCL buffers and allocator fragmentation (leave headroom), the
few-byte AdamW step counters, FSDP's param_dtype cast of a shard before an all-gather (a shard in
param_dtype), and rotary tables shared by all blocks (counted once per block that saves them).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Optional, Sequence

import torch
from torch import nn

from checkpointing.planner.metatrace import BlockMeasure, MetaProfile
from checkpointing.planner.param_bytes import GroupBytes, group_bytes, sharded_numel
from checkpointing.plan import BlockPlan
from checkpointing.planner.search import BlockOptions, Option, activation_peak
from checkpointing.planner.profile import OPTIONS


@dataclass(frozen=True)
class ParamGroup:
    """The parameters one fully_shard call owns: the root (outside the blocks) or one block."""

    name: str
    shapes: tuple[tuple[int, ...], ...]
    param_names: tuple[str, ...]
    # Per parameter: whether it trains (model.freeze and LoRA's base do not: no gradient, no
    # optimizer state), the bytes of an element as stored (LoRA's base in the compute dtype,
    # NF4's codes), and whether mixed precision casts it (floating). Empty: every parameter
    # trains, is floating and is stored in the setup's original dtype.
    trained: tuple[bool, ...] = ()
    itemsizes: tuple[Optional[int], ...] = ()
    floating: tuple[bool, ...] = ()
    transient_numel: int = 0  # compute-dtype elements made while it runs (param_bytes.py)

    def bytes(self, shard: int, orig: int, compute: int) -> GroupBytes:
        n = len(self.shapes)
        return group_bytes(self.shapes, self.trained or (True,) * n,
                           self.itemsizes or (None,) * n, self.floating or (True,) * n,
                           shard, orig, compute, self.transient_numel)


def param_groups(model: nn.Module, blocks: Sequence[nn.Module],
                 block_names: Sequence[str]) -> list[ParamGroup]:
    """Root group first, then one group per block; a tied parameter counts once (first seen)."""
    seen: set[int] = set()
    in_block: dict[int, int] = {id(p): i for i, b in enumerate(blocks) for p in b.parameters()}
    members: list[list[tuple[str, torch.Tensor]]] = [[] for _ in range(len(blocks) + 1)]
    for name, param in model.named_parameters():
        if id(param) in seen:
            continue
        seen.add(id(param))
        members[in_block.get(id(param), -1) + 1].append((name, param))
    names = ["(root)", *block_names]
    transient = [0, *(max((getattr(m, "dequantized_numel", 0) for m in b.modules()), default=0)
                      for b in blocks)]
    return [ParamGroup(names[i], tuple(tuple(p.shape) for _, p in m), tuple(n for n, _ in m),
                       tuple(p.requires_grad for _, p in m),
                       tuple(p.element_size() for _, p in m),
                       tuple(p.is_floating_point() for _, p in m), transient[i])
            for i, m in enumerate(members)]


@dataclass(frozen=True)
class Setup:
    """What, besides the model, decides per-rank memory."""

    mode: str  # fsdp | hsdp | none
    world_size: int
    shard: int  # ranks a parameter is sharded over
    grad_accum: int
    param_dtype: torch.dtype  # dtype of unsharded parameters and their gradients
    orig_dtype: torch.dtype  # sharded parameters, gradients, optimizer state
    reduce_dtype: torch.dtype
    reshard_after_forward: bool = True
    optimizer_foreach: bool = True  # CUDA AdamW default; CPU runs the per-parameter loop
    # sharding.cpu_offload: sharded parameters, gradients, optimizer state (and so the optimizer
    # step) live in host memory; the device holds the unsharded transients and activations.
    cpu_offload: bool = False
    # Activation offload that moves data (disk; cpu on a GPU): saved storages of at least this
    # many bytes leave the device between forward and backward. None: nothing moves.
    offload_min_bytes: Optional[int] = None
    # Where what moves goes: "cpu" (pinned host memory, counted in Estimate.host_activations)
    # or "disk".
    offload_target: str = "cpu"


@dataclass(frozen=True)
class Phase:
    name: str
    params: int  # sharded parameters
    grads: int  # sharded gradients (and DDP buckets) alive in this phase
    optimizer: int
    unsharded: int  # FSDP transients and optimizer-step temporaries
    activations: int

    @property
    def total(self) -> int:
        return self.params + self.grads + self.optimizer + self.unsharded + self.activations


@dataclass(frozen=True)
class Estimate:
    params: int
    grads: int
    optimizer: int
    activation_peak: int  # the chain formula (embedding stage, blocks, head)
    end_of_forward: int  # activations kept when the forward ends (rest + blocks' saved)
    no_checkpoint: int  # the same with no block recomputing
    recompute_flops: int  # per optimizer step (all micro-batches)
    host: int  # bytes in host memory instead (sharding.cpu_offload), else 0
    # Pinned host memory of the activations offloaded to the CPU, all of them out at the end of
    # the forward (per rank, one micro-batch at a time).
    host_activations: int
    peak: Phase  # the largest phase on the device
    phases: tuple[Phase, ...] = field(repr=False)
    block_saved: tuple[int, ...] = field(repr=False)  # per block, under the plan
    block_flops: tuple[int, ...] = field(repr=False)  # recompute FLOPs per block, one micro-batch


def _itemsize(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype, device="meta").element_size()


@dataclass(frozen=True)
class Fixed:
    """What every phase holds besides activations: the plan does not change it (activations 0).

    `blocks[i]` is block i's (computing, reducing) pair; the activations of a phase are then a
    term of the chain (see `estimate`), so `Fixed` plus a plan's chain is the whole prediction."""

    blocks: tuple[tuple[Phase, Phase], ...]
    head: Phase
    embedding: Phase  # embedding backward, root reduce-scatter
    optimizer: Phase
    host: int
    params: int  # per rank, wherever they live (sharding.cpu_offload: in host memory)
    grads: int
    optimizer_state: int


def fixed_phases(groups: Sequence[ParamGroup], profile: MetaProfile, setup: Setup) -> Fixed:
    """Per-rank bytes of every phase of a step except its activations."""
    orig, compute, reduce = (_itemsize(setup.orig_dtype), _itemsize(setup.param_dtype),
                             _itemsize(setup.reduce_dtype))
    sharded = setup.mode != "none"
    shard = setup.shard if sharded else 1
    counts = [g.bytes(shard, orig, compute) for g in groups]
    local = [c.trained for c in counts]  # sharded gradients (of the trained parameters) per group
    params, trained = sum(c.params for c in counts), sum(local)
    optimizer = 2 * trained
    ddp_buckets = trained if (not sharded and setup.world_size > 1) else 0
    grads_all = trained + ddp_buckets
    unsharded = [c.gathered for c in counts] if sharded else [0] * len(counts)
    reduce_in = [c.trained_gathered * reduce for c in counts] if sharded else [0] * len(counts)
    exact = [c.trained_exact for c in counts]
    root, n = 0, len(groups) - 1
    head_names = set(profile.head.grad_param_names)
    # Unsharded root gradients the head makes at the start of backward (FSDP: held until the
    # root's reduce-scatter at the end of backward; no FSDP: they are the gradients themselves).
    root_trained = groups[root].trained or (True,) * len(groups[root].shapes)
    head_grads = sum(math.prod(s or (1,)) * compute for s, n_, t in
                     zip(groups[root].shapes, groups[root].param_names, root_trained)
                     if n_ in head_names and t)
    all_root_grads = counts[root].trained_exact * compute
    multi = shard > 1  # a prefetched all-gather buffer exists only with more than one shard
    accumulating = setup.grad_accum > 1

    def present_grads(after_block: int) -> int:
        """Sharded gradients alive while block `after_block` (group index) runs backward."""
        if accumulating:
            return grads_all
        reduced = sum(local[j] for j in range(after_block + 1, len(groups)))
        if not sharded:  # plain gradients: the head's root gradients exist as well
            reduced += head_grads
        return reduced + ddp_buckets

    blocks = []
    for i in range(1, n + 1):
        if setup.reshard_after_forward:
            block_params = unsharded[i] * (2 if multi else 1)
        else:  # every block up to this one is still unsharded from the forward
            block_params = sum(unsharded[1:i + 1]) + (unsharded[i] if multi else 0)
        root_part = unsharded[root] + (head_grads if sharded else 0)
        # While the block's backward computes, the previous block's reduce-scatter input is
        # still held (FSDP keeps one in flight); at its post-backward hook, its own parameters
        # and activations are freed and its reduce-scatter input joins its unsharded gradients.
        computing = Phase(f"{groups[i].name} forward/backward", params, present_grads(i),
                          optimizer, root_part + block_params
                          + (reduce_in[i + 1] if i < n else 0), 0)
        own_grads = exact[i] * compute if sharded else 0
        reducing = Phase(f"{groups[i].name} reduce-scatter", params, present_grads(i),
                         optimizer, root_part + block_params - unsharded[i] + reduce_in[i]
                         + own_grads, 0)
        blocks.append((computing, reducing))
    last_block = unsharded[n] if n else 0
    head_params = (sum(unsharded[1:]) if not setup.reshard_after_forward
                   else (last_block if multi else 0))
    head = Phase("the head (output layer, loss) forward/backward", params,
                 grads_all if accumulating else ddp_buckets, optimizer,
                 unsharded[root] + head_params, 0)
    # FSDP: all root gradients, then (root parameters resharded) its reduce-scatter input.
    tail_grads = all_root_grads + max(unsharded[root], reduce_in[root]) if sharded else 0
    embedding = Phase("embedding backward, root reduce-scatter", params,
                      grads_all if accumulating or not sharded else sum(local[1:]),
                      optimizer, tail_grads, 0)
    step = Phase("the optimizer step", params, grads_all, optimizer,
                 _optimizer_temporaries(groups, shard, orig, setup.optimizer_foreach), 0)
    host = 0
    if setup.cpu_offload:  # the host copy of a block's shard moved in for its all-gather: small
        host = params + grads_all + optimizer

        def on_device(p: Phase, keep_transients: bool = True) -> Phase:
            return dataclasses.replace(p, params=0, grads=0, optimizer=0,
                                       unsharded=p.unsharded if keep_transients else 0)
        blocks = [(on_device(c), on_device(r)) for c, r in blocks]
        head, embedding, step = on_device(head), on_device(embedding), on_device(step, False)
    return Fixed(tuple(blocks), head, embedding, step, host, params, grads_all, optimizer)


def host_copies(groups: Sequence[ParamGroup], setup: Setup) -> tuple[tuple[int, ...], int]:
    """sharding.cpu_offload's bytes per micro-batch, per block group and for the root group:
    the parameter shard in for each all-gather (a block's in forward, and in backward again when
    resharded after forward; the root's once), the gradient shard out."""
    shard = setup.shard if setup.mode != "none" else 1
    counts = [g.bytes(shard, _itemsize(setup.orig_dtype), _itemsize(setup.param_dtype))
              for g in groups]
    gathers = 2 if setup.reshard_after_forward else 1
    return (tuple(gathers * c.params + c.trained for c in counts[1:]),
            counts[0].params + counts[0].trained)


def host_optimizer_numel(groups: Sequence[ParamGroup], setup: Setup) -> int:
    """The trained elements of this rank's shard (padded, as FSDP2 holds them): what the
    optimizer steps over, on the host under sharding.cpu_offload."""
    shard = setup.shard if setup.mode != "none" else 1
    return sum(g.bytes(shard, 4, 4).trained_gathered for g in groups) // shard


def moved_bytes(measure: BlockMeasure, plan: BlockPlan, min_bytes: int) -> int:
    if plan.offload == "none":
        return 0
    return measure.saved_bytes[plan.recompute] - measure.small_bytes(plan.recompute, min_bytes)


def _plan_chain(profile: MetaProfile, plan: Sequence[BlockPlan],
                setup: Setup) -> tuple[list[int], list[int]]:
    """(saved, K) of each chain element under `plan`: embedding stage, blocks, head."""
    before, head = profile.before_blocks_bytes, profile.head
    saved, peaks = [before], [before]
    previous_moved = 0  # what the block before this one moves (it is fetched during this one)
    for measure, step in zip(profile.blocks, plan, strict=True):
        moves = setup.offload_min_bytes is not None and step.offload != "none"
        kept = (measure.small_bytes(step.recompute, setup.offload_min_bytes) if moves
                else measure.saved_bytes[step.recompute])
        saved.append(kept)
        peaks.append(measure.peak_bytes[step.recompute] + previous_moved)
        previous_moved = (moved_bytes(measure, step, setup.offload_min_bytes) if moves else 0)
    saved.append(head.saved_bytes)
    peaks.append(head.saved_bytes + head.extra_bytes)
    return saved, peaks


def as_modelled(plan: Sequence[BlockPlan]) -> list[BlockPlan]:
    """The plan as the memory model sees it. A block whose recompute the compiler places
    ("compiler") counts as keeping everything: its placement is only known when it compiles,
    and it keeps at most that (an upper bound)."""
    return [dataclasses.replace(p, recompute="none") if p.recompute == "compiler" else p
            for p in plan]


def estimate(groups: Sequence[ParamGroup], profile: MetaProfile, plan: Sequence[BlockPlan],
             setup: Setup) -> Estimate:
    """Per-rank bytes of every phase of a step under `plan`, and the largest phase.

    Activations follow the chain formula (checkpointing/planner/search.py): while element i
    (embedding stage, block, head) runs, S_<i + K_i; a block's reduce-scatter holds S_<i."""
    plan = as_modelled(plan)
    fixed = fixed_phases(groups, profile, setup)
    saved, peaks = _plan_chain(profile, plan, setup)
    held, terms = 0, []
    for kept, k in zip(saved, peaks):
        terms.append(held + k)
        held += kept
    phases: list[Phase] = []
    for i, (computing, reducing) in enumerate(fixed.blocks, start=1):
        phases.append(max(dataclasses.replace(computing, activations=terms[i]),
                          dataclasses.replace(reducing, activations=terms[i] - peaks[i]),
                          key=lambda p: p.total))
    phases.append(dataclasses.replace(fixed.head, activations=terms[-1]))
    phases.append(dataclasses.replace(fixed.embedding, activations=terms[0]))
    phases.append(fixed.optimizer)
    chain = [BlockOptions(f"e{i}", (Option("kept", kept, 0.0),), k)
             for i, (kept, k) in enumerate(zip(saved, peaks))]
    peak_activations = activation_peak(chain, [0] * len(chain))
    # The phases take their activations from the same chain; the planner's formula is their
    # maximum (the head's term covers S_total, its K being at least its saved bytes).
    assert peak_activations == max(terms), (peak_activations, max(terms))
    block_saved = tuple(saved[1:-1])
    flops = tuple(m.recompute_flops[p.recompute] for m, p in zip(profile.blocks, plan))
    moving = setup.offload_min_bytes is not None and setup.offload_target == "cpu"
    host_activations = sum(moved_bytes(m, p, setup.offload_min_bytes)
                           for m, p in zip(profile.blocks, plan)) if moving else 0
    return Estimate(
        params=fixed.params, grads=fixed.grads, optimizer=fixed.optimizer_state,
        host_activations=host_activations,
        activation_peak=peak_activations,
        end_of_forward=profile.rest_bytes + sum(block_saved),
        no_checkpoint=profile.rest_bytes + sum(m.saved_bytes["none"] for m in profile.blocks),
        recompute_flops=sum(flops) * setup.grad_accum, host=fixed.host,
        peak=max(phases, key=lambda p: p.total),
        phases=tuple(phases), block_saved=block_saved, block_flops=flops)


def capacity_chain(fixed: Fixed, profile: MetaProfile,
                   blocks: Sequence[BlockOptions]) -> tuple[list[BlockOptions], int]:
    """The planner's chain for fitting a whole step into a capacity, and the least capacity no
    plan can go below (the optimizer step, which holds no activations).

    Phase totals are fixed part + activation term, and the planner knows one budget for all terms,
    so each element's K absorbs its fixed part: block i must satisfy C_i + S_<i + K_i <= X while
    computing and R_i + S_<i <= X while reducing, i.e. S_<i + max(C_i + K_i, R_i) <= X. With those
    K the planner's peak is the predicted step peak (the optimizer step aside), so
    `plan_budget(chain, X)` is the cheapest plan whose whole step fits X.

    `blocks`: each block's options (checkpointing/planner/policies.block_options,
    fold_prefetch=False).
    An offloaded block i is all back while block i+1 runs backward (fetched one block ahead):
    S_<i + saved_i + max(C_{i+1} + K_{i+1}, R_{i+1}), counted in the option's own K with the
    largest K of block i+1, so it holds whatever block i+1 chooses.
    """
    before, head = profile.before_blocks_bytes, profile.head

    def own(i: int, j: int) -> int:
        computing, reducing = fixed.blocks[i]
        return max(computing.total + blocks[i].peak_of(j), reducing.total)

    chain = [BlockOptions("(embedding stage)", (Option("kept", before, 0.0),),
                          fixed.embedding.total + before)]
    for i, block in enumerate(blocks):
        ahead = (max(own(i + 1, j) for j in range(len(blocks[i + 1].options)))
                 if i + 1 < len(blocks) else fixed.head.total + head.saved_bytes + head.extra_bytes)
        options = []
        for j, option in enumerate(block.options):
            k = own(i, j)
            if option.name.endswith("+offload"):
                recompute = option.name.split("+")[0]
                full = next(o.saved_bytes for o in block.options if o.name == recompute)
                k = max(k, full + ahead)
            options.append(dataclasses.replace(option, peak_bytes=k))
        chain.append(BlockOptions(block.name, tuple(options), 0))
    chain.append(BlockOptions("(head)", (Option("kept", head.saved_bytes, 0.0),),
                              fixed.head.total + head.saved_bytes + head.extra_bytes))
    return chain, fixed.optimizer.total


def _optimizer_temporaries(groups: Sequence[ParamGroup], shard: int, orig: int,
                           foreach: bool) -> int:
    """AdamW's step temporaries: the foreach path makes sqrt(exp_avg_sq) for a whole param group
    at once (the trainer's groups: matrices with decay, vectors without); the per-parameter path
    holds sqrt and its quotient for one parameter."""
    shapes = [s for g in groups for s, t in zip(g.shapes, g.trained or (True,) * len(g.shapes))
              if t]  # AdamW steps the trained parameters only
    sizes = [sharded_numel(s, shard) * orig for s in shapes]
    if not sizes:
        return 0
    if not foreach:
        return 2 * max(sizes)
    decay = sum(b for s, b in zip(shapes, sizes) if len(s) >= 2)
    return max(decay, sum(sizes) - decay)
