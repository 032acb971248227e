"""Carrying out `train.compile`: each block's (possibly checkpointed) forward, compiled.

Only the forward is compiled, on that instance, after the checkpoint wrapper and before the
offload hooks and `fully_shard`'s hooks, which therefore stay outside the compiled region:

- The checkpoint is traced into the graph, so the compiler sees what is recomputed.
- What the compiled forward keeps for backward is saved as one autograd function's saved
  tensors, outside the graph, where saved-tensor hooks see it. So the offload hooks move what
  the compiled backward keeps, and the saved-bytes meter counts it (selective checkpointing's
  cache included, since inside the graph it is ordinary saved tensors).
- FSDP2's unshard/reshard hooks run eagerly around the compiled forward, as without compile.

Identical blocks share one compiled graph: dynamo caches per code object and treats the
parameters of a module as inputs, so the second block of the same class and shapes hits the
first one's cache entry.

`recompute="compiler"`: no checkpoint wrapper; the partitioner places recompute inside the
block under the plan's `memory_budget` (torch._functorch.config.activation_memory_budget). That
setting is read when a graph is compiled, and dynamo does not guard on it, so a graph compiled
under one budget would be reused under another: each budget gets its own code object.

One entry function per kind of block: dynamo keeps its compiled graphs per code object and
allows only `recompile_limit` (8) of them each. Compiling every block through one shared
function (the checkpoint wrapper's, or the block class's own forward) let a model with many
kinds of blocks (recompute option, budget, shapes) -- or a process that builds many models --
reach that limit; past it dynamo runs the function eagerly but still runs graphs cached on the
functions it calls, so an eager selective checkpoint could run a compiled graph inside its
recompute and fail in backward ("Trying to backward an extra time"). Here each kind (block
class, parameter shapes, recompute option, budget, tiles) calls through a function with a code
object of its own, so a code object only ever sees the blocks that share one graph, and
nothing compiles the block's own forward as an entry.
"""

from __future__ import annotations

import functools
import types
from typing import Callable, Optional, Sequence

import torch
from torch import nn

from checkpointing.plan import BlockPlan

# (block kind, memory budget) -> the entry function its blocks are compiled through.
_ENTRIES: dict[tuple, Callable] = {}


def _enter(forward: Callable, *args, **kwargs):
    return forward(*args, **kwargs)


def _block_kind(block: nn.Module) -> tuple:
    """What decides a block's graph: its class, parameter shapes, recompute option and tiles."""
    params = tuple((name, tuple(p.shape), str(p.dtype), p.requires_grad)
                   for name, p in block.named_parameters())
    tiles = tuple(getattr(m, "_blocktrain_tiles", 1) for m in block.modules())
    recompute = getattr(block, "_blocktrain_recompute", None) or "none"
    return type(block).__module__, type(block).__qualname__, recompute, params, tiles


def entry_for(kind: tuple, memory_budget: Optional[float]) -> Callable:
    """A function like _enter with a code object of its own for this kind of block."""
    key = (kind, memory_budget)
    if key not in _ENTRIES:
        label = kind[2] if memory_budget is None else f"compiler_budget_{memory_budget:g}"
        name = f"blocktrain_{label}_block_{len(_ENTRIES)}"
        code = _enter.__code__.replace(co_name=name, co_qualname=name)
        _ENTRIES[key] = types.FunctionType(code, _enter.__globals__, name)
    return _ENTRIES[key]


def _with_budget(compiled: Callable, budget: float, *args, **kwargs):
    import torch._functorch.config as functorch_config

    # Read by the partitioner when this call compiles (the first call, and any recompile).
    with functorch_config.patch(activation_memory_budget=budget):
        return compiled(*args, **kwargs)


def compile_block(block: nn.Module, backend: str, memory_budget: Optional[float] = None) -> None:
    entry = entry_for(_block_kind(block), memory_budget)
    # Under a budget, fixed shapes: a dynamic-shape graph made under one budget must not serve
    # another shape. The block's forward (checkpointed or not) is an argument the graph inlines.
    compiled = torch.compile(entry, backend=backend,
                             dynamic=None if memory_budget is None else False)
    forward = functools.partial(compiled, block.forward)
    if memory_budget is not None:
        forward = functools.partial(_with_budget, forward, memory_budget)
    block.forward = forward
    block._blocktrain_compiled = backend


def compile_blocks(blocks: Sequence[nn.Module], plan: Sequence[BlockPlan], backend: str) -> int:
    """Compile every block's forward as planned; the number of blocks compiled."""
    for block, block_plan in zip(blocks, plan, strict=True):
        budget = block_plan.memory_budget if block_plan.recompute == "compiler" else None
        compile_block(block, backend, budget)
    return len(blocks)


def graphs_compiled() -> int:
    """Distinct graphs dynamo has compiled in this process so far."""
    from torch._dynamo.utils import counters

    return int(counters["stats"]["unique_graphs"])
