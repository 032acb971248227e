"""Which torch APIs the project uses, and whether the installed torch has each of them.

    python -m launch.torch_api [--json]

The list is not kept by hand (it would rot): every `.py` file of the project's packages is
parsed, imports of torch are followed through their aliases (`import torch.distributed as dist`,
`from torch.utils.checkpoint import checkpoint`), and every dotted name read through them
(`dist.distributed_c10d._get_default_store`) is looked up in the installed torch. The GPU host
runs another torch than CI (2.11 against 2.13), so the GPU check runs this first and says what
is missing before anything fails halfway through a run.
"""

from __future__ import annotations

import argparse
import ast
import importlib
import json
import os
import sys
from dataclasses import dataclass
from typing import Iterator, Optional

PACKAGES = ("trainer", "sharding", "checkpointing", "offload", "launch")
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@dataclass(frozen=True)
class Use:
    name: str  # fully qualified, e.g. "torch.distributed.fsdp.fully_shard"
    where: str  # "path:line" of its first use


def _aliases(tree: ast.AST) -> dict[str, str]:
    """Local name -> the torch name it stands for, from every import in the file (also the
    imports inside functions: the project imports heavy modules late)."""
    names: dict[str, str] = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name == "torch" or alias.name.startswith("torch."):
                    # `import torch.distributed` binds `torch`; `... as dist` binds the module.
                    names[alias.asname or "torch"] = alias.name if alias.asname else "torch"
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            if node.module == "torch" or node.module.startswith("torch."):
                for alias in node.names:
                    names[alias.asname or alias.name] = f"{node.module}.{alias.name}"
    return names


def _dotted(node: ast.AST) -> Optional[list[str]]:
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if isinstance(node, ast.Name):
        return [node.id, *reversed(parts)]
    return None


def uses_in(path: str, source: str) -> Iterator[Use]:
    tree = ast.parse(source, filename=path)
    aliases = _aliases(tree)
    rel = os.path.relpath(path, REPO)
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0 and (
                node.module == "torch" or node.module.startswith("torch.")):
            for alias in node.names:
                yield Use(f"{node.module}.{alias.name}", f"{rel}:{node.lineno}")
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.startswith("torch"):
                    yield Use(alias.name, f"{rel}:{node.lineno}")
        elif isinstance(node, ast.Attribute):  # sub-chains are dropped later (longest_chains)
            parts = _dotted(node)
            if parts and parts[0] in aliases:
                yield Use(".".join([aliases[parts[0]], *parts[1:]]), f"{rel}:{node.lineno}")


def project_uses(packages: tuple[str, ...] = PACKAGES) -> dict[str, str]:
    """Every torch name the packages read, with where it is first used."""
    found: dict[str, str] = {}
    for package in packages:
        for folder, _, files in os.walk(os.path.join(REPO, package)):
            for name in sorted(files):
                if name.endswith(".py"):
                    path = os.path.join(folder, name)
                    with open(path) as f:
                        tree_uses = list(uses_in(path, f.read()))
                    for use in tree_uses:
                        found.setdefault(use.name, use.where)
    return found


def resolve(name: str) -> bool:
    """True if `name` is a module, or an attribute reachable from the longest importable prefix.
    Chains that continue past a callable's result are not written as plain dotted names, so
    every prefix here is a module, a class or a namespace object."""
    parts = name.split(".")
    for cut in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:cut]))
        except Exception:
            continue
        for attr in parts[cut:]:
            try:
                obj = getattr(obj, attr)
            except Exception:
                return False
        return True
    return False


def longest_chains(uses: dict[str, str]) -> dict[str, str]:
    """Keep only the longest chains: `torch.cuda.Event` covers `torch.cuda`."""
    names = sorted(uses)
    return {n: uses[n] for i, n in enumerate(names)
            if not (i + 1 < len(names) and names[i + 1].startswith(n + "."))}


def check() -> dict:
    import torch

    from trainer.config import DEFAULT_SAVE_OPS  # looked up by name at run time

    uses = longest_chains(project_uses())
    for op in DEFAULT_SAVE_OPS:
        uses.setdefault(f"torch.ops.aten.{op}", "checkpointing.save_ops (default)")
    missing = {name: where for name, where in uses.items() if not resolve(name)}
    return {"torch": torch.__version__, "checked": len(uses), "missing": missing}


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", action="store_true", help="print the result as JSON")
    args = parser.parse_args(argv)
    result = check()
    if args.json:
        print(json.dumps(result))
    else:
        print(f"torch {result['torch']}: {result['checked']} torch names used by the project")
        for name, where in sorted(result["missing"].items()):
            print(f"missing: {name} (used at {where})")
        if not result["missing"]:
            print("all present")
    return 1 if result["missing"] else 0


if __name__ == "__main__":
    sys.exit(main())
