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
"""

from __future__ import annotations

import functools
from typing import Callable, Optional, Sequence

import torch
from torch import nn

from checkpointing.plan import BlockPlan

_BUDGET_FORWARDS: dict[float, Callable] = {}


def _under_budget(original: Callable, *args, **kwargs):
    return original(*args, **kwargs)


def _forward_for(budget: float) -> Callable:
    """A function like _under_budget with a code object of its own for this budget."""
    if budget not in _BUDGET_FORWARDS:
        code = _under_budget.__code__.replace(co_name=f"block_under_memory_budget_{budget:g}")
        _BUDGET_FORWARDS[budget] = type(_under_budget)(code, _under_budget.__globals__,
                                                       code.co_name)
    return _BUDGET_FORWARDS[budget]


def _with_budget(compiled: Callable, budget: float, *args, **kwargs):
    import torch._functorch.config as functorch_config

    # Read by the partitioner when this call compiles (the first call, and any recompile).
    with functorch_config.patch(activation_memory_budget=budget):
        return compiled(*args, **kwargs)


def _compiled(forward: Callable, backend: str, dynamic: Optional[bool]) -> Callable:
    if isinstance(forward, functools.partial):
        # Compile the function and bind its arguments outside: a compiled partial runs through
        # one dynamo wrapper shared by every partial, whose cache every kind of block would
        # fill, up to dynamo's recompile limit.
        return functools.partial(torch.compile(forward.func, backend=backend, dynamic=dynamic),
                                 *forward.args, **forward.keywords)
    return torch.compile(forward, backend=backend, dynamic=dynamic)


def compile_block(block: nn.Module, backend: str, memory_budget: Optional[float] = None) -> None:
    if memory_budget is None:
        block.forward = _compiled(block.forward, backend, None)
    else:
        # Fixed shapes: a dynamic-shape graph made under one budget must not serve another shape.
        forward = functools.partial(_forward_for(memory_budget), block.forward)
        block.forward = functools.partial(_with_budget, _compiled(forward, backend, False),
                                          memory_budget)
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
