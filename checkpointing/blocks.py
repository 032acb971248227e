"""Finding a model's blocks, for any nn.Module.

A block is one of the repeated units that hold most of a model's parameters and activations
(decoder layers, ViT encoder layers, ...). Every memory decision is made per block, so this is the
only place that needs to know where they are, and it knows nothing about any architecture.
"""

from __future__ import annotations

import fnmatch

from torch import nn


_WRAPPER_LEVELS = ("_checkpoint_wrapped_module.", "_orig_mod.", "_fsdp_wrapped_module.")


def canonical_name(name: str) -> str:
    """A parameter or module path as the user's model spells it.

    Wrappers applied per block (checkpointing, compile, DDP) insert a level into the path; block
    patterns, initialisation seeds and checkpoints are keyed by the unwrapped path.
    """
    if name.startswith("module."):  # DDP
        name = name[len("module."):]
    for level in _WRAPPER_LEVELS:
        name = name.replace(level, "")
    return name


def find_blocks(model: nn.Module, pattern: str | None = None) -> list[tuple[str, nn.Module]]:
    """(dotted name, module) of each block, in forward order.

    pattern: an fnmatch glob over module paths (e.g. "layers.*", "encoder.layer.*"); the outermost
    matching modules are the blocks. None: the children of the ModuleList/Sequential whose
    same-class children hold the most parameters (at least two of them).
    """
    if pattern is not None:
        blocks: list[tuple[str, nn.Module]] = []
        for name, module in model.named_modules():
            clean = canonical_name(name)
            if name and fnmatch.fnmatchcase(clean, pattern):
                if not any(clean.startswith(outer + ".") for outer, _ in blocks):
                    blocks.append((clean, module))
        if not blocks:
            raise ValueError(f"model.block_pattern={pattern!r} matches no module; module paths "
                             f"look like: {', '.join(_sample_paths(model))}")
        return blocks

    best: list[tuple[str, nn.Module]] = []
    best_params = 0
    for name, container in model.named_modules():
        if not isinstance(container, (nn.ModuleList, nn.Sequential)):
            continue
        children = list(container.named_children())
        if len(children) < 2 or len({type(m) for _, m in children}) != 1:
            continue
        total = sum(p.numel() for p in container.parameters())
        if total > best_params:
            prefix = canonical_name(name) + "." if name else ""
            best, best_params = [(prefix + child, m) for child, m in children], total
    if not best:
        raise ValueError("found no repeated blocks (a ModuleList/Sequential of at least two "
                         "modules of one class); set model.block_pattern, e.g. 'layers.*'")
    return best


def _sample_paths(model: nn.Module, limit: int = 6) -> list[str]:
    names = [canonical_name(n) for n, _ in model.named_modules() if n and n.count(".") <= 1]
    return names[:limit]
