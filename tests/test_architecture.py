"""The folders are the architecture, and the arrows point one way: `launch/` may use everything,
`trainer/` composes `checkpointing/`, `offload/` and `sharding/`, and those three never import
anything above them (nor `launch/`), not even inside a function."""

from __future__ import annotations

import ast

import pytest

from tests.helpers import REPO

ABOVE = {"checkpointing": {"trainer", "launch"}, "offload": {"trainer", "launch"},
         "sharding": {"trainer", "launch"}, "trainer": {"launch"}}


def imported_packages(path) -> set[tuple[str, int]]:
    """(top-level package, line) of every import in a file, function-local ones included."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            found |= {(alias.name.split(".")[0], node.lineno) for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.add((node.module.split(".")[0], node.lineno))
    return found


@pytest.mark.parametrize("folder", sorted(ABOVE))
def test_a_folder_never_imports_one_above_it(folder: str) -> None:
    wrong = [f"{path.relative_to(REPO)}:{line} imports {package}"
             for path in sorted((REPO / folder).rglob("*.py"))
             for package, line in sorted(imported_packages(path)) if package in ABOVE[folder]]
    assert wrong == []


def test_the_check_sees_an_upward_import(tmp_path) -> None:
    sample = tmp_path / "x.py"
    sample.write_text("def f():\n    from trainer.config import Config\n    import launch.slurm\n")
    assert imported_packages(sample) == {("trainer", 2), ("launch", 3)}
