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
  activations the chain formula of checkpointing.planner.activation_peak over the embedding
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
from typing import Sequence

import torch
from torch import nn

from checkpointing.metatrace import MetaProfile
from checkpointing.plan import BlockPlan
from checkpointing.planner import BlockOptions, Option, activation_peak
from checkpointing.profile import OPTIONS


@dataclass(frozen=True)
class ParamGroup:
    """The parameters one fully_shard call owns: the root (outside the blocks) or one block."""

    name: str
    shapes: tuple[tuple[int, ...], ...]
    param_names: tuple[str, ...]


def param_groups(model: nn.Module, blocks: Sequence[nn.Module],
                 block_names: Sequence[str]) -> list[ParamGroup]:
    """Root group first, then one group per block; a tied parameter counts once (first seen)."""
    seen: set[int] = set()
    in_block: dict[int, int] = {id(p): i for i, b in enumerate(blocks) for p in b.parameters()}
    members: list[list[tuple[str, tuple[int, ...]]]] = [[] for _ in range(len(blocks) + 1)]
    for name, param in model.named_parameters():
        if id(param) in seen:
            continue
        seen.add(id(param))
        members[in_block.get(id(param), -1) + 1].append((name, tuple(param.shape)))
    names = ["(root)", *block_names]
    return [ParamGroup(names[i], tuple(s for _, s in m), tuple(n for n, _ in m))
            for i, m in enumerate(members)]


def sharded_numel(shape: tuple[int, ...], shard: int) -> int:
    """FSDP2's local shard: dim 0 split in `shard` chunks of ceil(dim0 / shard) rows (padded)."""
    dims = shape or (1,)
    return math.ceil(dims[0] / shard) * math.prod(dims[1:])


def group_numel(group: ParamGroup, shard: int) -> tuple[int, int, int]:
    """(sharded, unsharded padded as all-gathered, exact) element counts of a group."""
    local = sum(sharded_numel(s, shard) for s in group.shapes)
    exact = sum(math.prod(s or (1,)) for s in group.shapes)
    return local, local * shard, exact


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
    peak: Phase  # the largest phase on the device
    phases: tuple[Phase, ...] = field(repr=False)
    block_saved: tuple[int, ...] = field(repr=False)  # per block, under the plan
    block_flops: tuple[int, ...] = field(repr=False)  # recompute FLOPs per block, one micro-batch


def _itemsize(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype, device="meta").element_size()


def _chain(profile: MetaProfile, plan: Sequence[BlockPlan]) -> tuple[list[BlockOptions], list[int]]:
    """The activation chain: embedding stage, blocks (K of the chosen option), head."""
    before = profile.before_blocks_bytes
    head = profile.head
    chain = [BlockOptions("(embedding stage)", (Option("kept", before, 0.0),), before)]
    choice = [0]
    for name, measure, step in zip(profile.block_names, profile.blocks, plan, strict=True):
        options = tuple(Option(o, measure.saved_bytes[o], 0.0) for o in OPTIONS)
        chain.append(BlockOptions(name, options, measure.peak_bytes[step.recompute]))
        choice.append(OPTIONS.index(step.recompute))
    chain.append(BlockOptions("(head)", (Option("kept", head.saved_bytes, 0.0),),
                              head.saved_bytes + head.extra_bytes))
    choice.append(0)
    return chain, choice


def _chain_terms(chain: Sequence[BlockOptions], choice: Sequence[int]) -> list[int]:
    """S_<i + K_i for each element: the activation bytes while element i runs."""
    held, terms = 0, []
    for element, index in zip(chain, choice):
        terms.append(held + element.peak_bytes)
        held += element.options[index].saved_bytes
    return terms


def estimate(groups: Sequence[ParamGroup], profile: MetaProfile, plan: Sequence[BlockPlan],
             setup: Setup) -> Estimate:
    """Per-rank bytes of every phase of a step under `plan`, and the largest phase."""
    orig, compute, reduce = (_itemsize(setup.orig_dtype), _itemsize(setup.param_dtype),
                             _itemsize(setup.reduce_dtype))
    sharded = setup.mode != "none"
    shard = setup.shard if sharded else 1
    counts = [group_numel(g, shard) for g in groups]
    local = [c[0] * orig for c in counts]  # sharded params = sharded grads, per group
    params, optimizer = sum(local), 2 * sum(local)
    ddp_buckets = params if (not sharded and setup.world_size > 1) else 0
    grads_all = params + ddp_buckets
    unsharded = [c[1] * compute for c in counts] if sharded else [0] * len(counts)
    reduce_in = [c[1] * reduce for c in counts] if sharded else [0] * len(counts)
    exact = [c[2] for c in counts]
    root, blocks = 0, range(1, len(groups))
    head_names = set(profile.head.grad_param_names)
    # Unsharded root gradients the head makes at the start of backward (FSDP: held until the
    # root's reduce-scatter at the end of backward; no FSDP: they are the gradients themselves).
    head_grads = sum(math.prod(s or (1,)) * compute for s, n in
                     zip(groups[root].shapes, groups[root].param_names) if n in head_names)
    all_root_grads = counts[root][2] * compute
    multi = shard > 1  # a prefetched all-gather buffer exists only with more than one shard
    accumulating = setup.grad_accum > 1

    chain, choice = _chain(profile, plan)
    terms = _chain_terms(chain, choice)
    phases: list[Phase] = []

    def present_grads(after_block: int) -> int:
        """Sharded gradients alive while block `after_block` (group index) runs backward."""
        if accumulating:
            return grads_all
        reduced = sum(local[j] for j in range(after_block + 1, len(groups)))
        if not sharded:  # plain gradients: the head's root gradients exist as well
            reduced += head_grads
        return reduced + ddp_buckets

    n = len(groups) - 1
    for i in blocks:
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
                          + (reduce_in[i + 1] if i < n else 0), terms[i])
        own_grads = exact[i] * compute if sharded else 0
        reducing = Phase(f"{groups[i].name} reduce-scatter", params, present_grads(i),
                         optimizer, root_part + block_params - unsharded[i] + reduce_in[i]
                         + own_grads, terms[i] - chain[i].peak_bytes)
        phases.append(max(computing, reducing, key=lambda p: p.total))
    last_block = unsharded[n] if n else 0
    head_params = (sum(unsharded[1:]) if not setup.reshard_after_forward
                   else (last_block if multi else 0))
    phases.append(Phase("the head (output layer, loss) forward/backward", params,
                        grads_all if accumulating else ddp_buckets, optimizer,
                        unsharded[root] + head_params, terms[-1]))
    # FSDP: all root gradients, then (root parameters resharded) its reduce-scatter input.
    tail_grads = all_root_grads + max(unsharded[root], reduce_in[root]) if sharded else 0
    phases.append(Phase("embedding backward, root reduce-scatter", params,
                        grads_all if accumulating or not sharded else sum(local[1:]),
                        optimizer, tail_grads, terms[0]))
    phases.append(Phase("the optimizer step", params, grads_all, optimizer,
                        _optimizer_temporaries(groups, shard, orig, setup.optimizer_foreach), 0))

    host = 0
    if setup.cpu_offload:  # the host copy of a block's shard moved in for its all-gather: small
        host = params + grads_all + optimizer
        phases = [dataclasses.replace(p, params=0, grads=0, optimizer=0,
                                      unsharded=0 if p is phases[-1] else p.unsharded)
                  for p in phases]
    peak_activations = activation_peak(chain, choice)
    # The phases above take their activations from the same chain; the planner's formula is
    # their maximum (the head's term covers S_total, its K being at least its saved bytes).
    assert peak_activations == max(terms), (peak_activations, max(terms))
    saved = tuple(m.saved_bytes[p.recompute] for m, p in zip(profile.blocks, plan))
    flops = tuple(m.recompute_flops[p.recompute] for m, p in zip(profile.blocks, plan))
    return Estimate(
        params=params, grads=grads_all, optimizer=optimizer, activation_peak=peak_activations,
        end_of_forward=profile.rest_bytes + sum(saved),
        no_checkpoint=profile.rest_bytes + sum(m.saved_bytes["none"] for m in profile.blocks),
        recompute_flops=sum(flops) * setup.grad_accum, host=host,
        peak=max(phases, key=lambda p: p.total),
        phases=tuple(phases), block_saved=saved, block_flops=flops)


def _optimizer_temporaries(groups: Sequence[ParamGroup], shard: int, orig: int,
                           foreach: bool) -> int:
    """AdamW's step temporaries: the foreach path makes sqrt(exp_avg_sq) for a whole param group
    at once (the trainer's groups: matrices with decay, vectors without); the per-parameter path
    holds sqrt and its quotient for one parameter."""
    shapes = [s for g in groups for s in g.shapes]
    sizes = [sharded_numel(s, shard) * orig for s in shapes]
    if not sizes:
        return 0
    if not foreach:
        return 2 * max(sizes)
    decay = sum(b for s, b in zip(shapes, sizes) if len(s) >= 2)
    return max(decay, sum(sizes) - decay)
