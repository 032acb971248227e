"""The folders are the architecture, and the arrows point one way: `launch/` may use everything,
`trainer/` composes `checkpointing/`, `offload/` and `sharding/`, and those three never import
anything above them (nor `launch/`), not even inside a function. No package imports one that
imports it back, no module circle, and the rooms (the planner, the benchmarks) stay closed.
(The other house rules, lengths and who may ask what, are tests/test_architecture.py's.)"""

from __future__ import annotations

import ast
import importlib.util
import subprocess
import sys

import pytest

from tests.helpers import REPO, subprocess_env

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


# Inside trainer/: each unit (a sub-package, or a module at the top) imports only units before
# it. Models, data and state never reach the loop, the report or W&B; the entry points come last.
TRAINER_ORDER = ("config", "distenv", "faults", "models", "data", "validate", "task", "state",
                 "optim", "build", "preflight", "observe", "loop", "cli", "__main__",
                 "report", "export", "generate", "tokenize", "workspace")
PROJECT = ("trainer", "checkpointing", "offload", "sharding", "launch")


def module_name(path) -> str:
    parts = list(path.relative_to(REPO).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _type_only(tree: ast.AST) -> set[int]:
    """ids of the import nodes under `if TYPE_CHECKING:`: names for annotations, never run."""
    return {id(inner) for node in ast.walk(tree) if isinstance(node, ast.If)
            and isinstance(node.test, ast.Name) and node.test.id == "TYPE_CHECKING"
            for inner in ast.walk(node)}


def imported_modules(path, known: set[str]) -> set[str]:
    """The project's modules a file imports at run time (function-local imports too; not those
    under `if TYPE_CHECKING:`); `from pkg import mod` counts as importing pkg.mod where that is a
    module."""
    found = set()
    tree = ast.parse(path.read_text(), filename=str(path))
    type_only = _type_only(tree)
    for node in ast.walk(tree):
        if id(node) in type_only:
            continue
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.add(node.module)
            found |= {f"{node.module}.{alias.name}" for alias in node.names}
    return {name for name in found if name in known}


def project_graph() -> dict[str, set[str]]:
    paths = [p for folder in PROJECT for p in sorted((REPO / folder).rglob("*.py"))]
    known = {module_name(p) for p in paths}
    return {module_name(p): imported_modules(p, known) - {module_name(p)} for p in paths}


def trainer_unit(module: str) -> str:
    return module.split(".")[1] if module.count(".") else "__init__"


def test_trainer_units_import_only_units_before_them() -> None:
    graph = project_graph()
    units = {trainer_unit(m) for m in graph if m.startswith("trainer.")} - {"__init__"}
    assert units <= set(TRAINER_ORDER), f"place {units - set(TRAINER_ORDER)} in TRAINER_ORDER"
    rank = {unit: i for i, unit in enumerate(TRAINER_ORDER)}
    wrong = [f"{m} imports {d}" for m, deps in sorted(graph.items()) if m.startswith("trainer.")
             and trainer_unit(m) in rank for d in sorted(deps) if d.startswith("trainer.")
             and trainer_unit(d) in rank and rank[trainer_unit(d)] > rank[trainer_unit(m)]]
    assert wrong == []


def test_trainer_top_level_holds_only_the_core() -> None:
    modules = sorted(p.name for p in (REPO / "trainer").glob("*.py"))
    assert len(modules) <= 15, modules


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Every strongly connected group of more than one module (Tarjan's algorithm)."""
    index, low, stack, on_stack, found = {}, {}, [], set(), []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for nxt in graph.get(node, ()):
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in on_stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            group = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                group.append(member)
                if member == node:
                    break
            if len(group) > 1:
                found.append(sorted(group))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return found


def test_no_import_circle_anywhere() -> None:
    assert cycles(project_graph()) == []


def test_the_checks_see_a_circle_and_a_wrong_arrow(tmp_path) -> None:
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert cycles({"a": {"b"}, "b": set()}) == []
    sample = tmp_path / "trainer" / "models" / "x.py"
    sample.parent.mkdir(parents=True)
    sample.write_text("def f():\n    from trainer import loop\n"
                      "    import trainer.preflight.tables\n"
                      "if TYPE_CHECKING:\n    from trainer.cli import check\n")
    known = {"trainer.loop", "trainer.preflight.tables", "trainer", "trainer.cli"}
    assert imported_modules(sample, known) == {"trainer", "trainer.loop",
                                               "trainer.preflight.tables"}


# Rooms: the planner (checkpointing/planner/) stands above the three strategies, and the plan at
# the ground of checkpointing/ (plan, blocks, meter, wrap, compiled, head), offload/ and sharding/
# never reach up to it; the benchmark room (launch/bench/) is reached only from launch/ (and the
# tests), so the trainer and the GPU check never run a benchmark's code by accident.
PLANNER, BENCH = "checkpointing.planner", "launch.bench"


def imported_names(path, package: str) -> set[tuple[str, int]]:
    """(dotted name, line) of every import in a file, function-local and type-only ones too;
    relative ones resolved against `package`; `from pkg import mod` also gives pkg.mod."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            found |= {(alias.name, node.lineno) for alias in node.names}
        elif isinstance(node, ast.ImportFrom):
            parts = package.split(".")
            base = parts[:len(parts) - node.level + 1] if node.level else []
            module = ".".join(base + ([node.module] if node.module else []))
            found.add((module, node.lineno))
            found |= {(f"{module}.{alias.name}", node.lineno) for alias in node.names}
    return found


def _inside(name: str, room: str) -> bool:
    return name == room or name.startswith(room + ".")


def room_violations(root) -> list[str]:
    """Imports into a room from where it is closed: the planner from the ground of
    checkpointing/ or from offload/ or sharding/; the benchmark room from outside launch/."""
    wrong = []
    for folder in PROJECT:
        for path in sorted((root / folder).rglob("*.py")):
            rel = path.relative_to(root)
            package = ".".join(rel.parent.parts)
            closed = [] if folder == "launch" else [BENCH]
            if folder in ("offload", "sharding") or (folder == "checkpointing"
                                                     and not _inside(package, PLANNER)):
                closed.append(PLANNER)
            crossing = {}  # line -> the shortest name it imports inside a closed room
            for name, line in sorted(imported_names(path, package)):
                if any(_inside(name, room) for room in closed):
                    crossing.setdefault(line, name)
            wrong += [f"{rel.as_posix()}:{line} imports {name}" for line, name in crossing.items()]
    return wrong


def test_the_ground_never_imports_the_planner_and_only_launch_imports_the_benchmarks() -> None:
    assert (REPO / "checkpointing" / "planner" / "__init__.py").is_file()
    assert (REPO / "launch" / "bench" / "__init__.py").is_file()
    assert room_violations(REPO) == []


def _plant(root, files: dict[str, str]) -> None:
    """Write a made-up project: each path under `root` with its text."""
    for name, text in files.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(text)


def test_the_room_check_sees_a_planted_import(tmp_path) -> None:
    files = {"checkpointing/wrap.py": "def f():\n    from checkpointing.planner.search import x\n",
             "checkpointing/head.py": "from . import planner\n",
             "checkpointing/planner/memory.py": "from checkpointing.planner import search\n"
                                                "from .search import y\n",
             "offload/apply.py": "if TYPE_CHECKING:\n    import checkpointing.planner.profile\n",
             "sharding/fsdp.py": "from checkpointing.plan import BlockPlan\n",
             "trainer/loop.py": "def g():\n    from launch.bench import plain\n",
             "launch/gpu_bench.py": "from launch.bench.plain import main\n"}
    _plant(tmp_path, files)
    assert sorted(room_violations(tmp_path)) == [
        "checkpointing/head.py:1 imports checkpointing.planner",
        "checkpointing/wrap.py:2 imports checkpointing.planner.search",
        "offload/apply.py:2 imports checkpointing.planner.profile",
        "trainer/loop.py:2 imports launch.bench"]


# The documented benchmark commands of before the room, kept working by a forwarder each.
FORWARDED = {"checkpointing.bench": "launch.bench", "checkpointing.head_bench": "launch.bench.head",
             "trainer.data.bench": "launch.bench.data"}


def test_a_benchmark_command_of_before_the_room_runs_its_new_home() -> None:
    for old, new in FORWARDED.items():
        forwarder = (REPO / old.replace(".", "/")).with_suffix(".py").read_text()
        assert f'"-m", "{new}"' in forwarder and importlib.util.find_spec(new), old
    done = subprocess.run([sys.executable, "-m", "checkpointing.bench", "--help"], cwd=REPO,
                          env=subprocess_env(), capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and "usage: python -m launch.bench " in done.stdout, done.stderr


def package_of(module: str) -> str:
    """The package a module counts for: its top-level package, or for trainer/ its sub-package
    (trainer.models, trainer.state, ...; a module at trainer/'s top is its own unit)."""
    parts = module.split(".")
    if parts[0] != "trainer" or len(parts) == 1:
        return parts[0]
    return ".".join(parts[:2])


def package_circles(graph: dict[str, set[str]]) -> list[str]:
    """Pairs of packages (top-level ones, and trainer's sub-packages) each importing the other
    at run time, with one import each way that makes the arrow."""
    by_package: dict[tuple[str, str], str] = {}
    for module, deps in sorted(graph.items()):
        for dep in sorted(deps):
            for level in (lambda m: m.split(".")[0], package_of):
                edge = (level(module), level(dep))
                if edge[0] != edge[1]:
                    by_package.setdefault(edge, f"{module} -> {dep}")
    return sorted(f"{a} <-> {b}: {by_package[a, b]}; {by_package[b, a]}"
                  for a, b in by_package if a < b and (b, a) in by_package)


def test_no_package_imports_one_that_imports_it_back() -> None:
    assert package_circles(project_graph()) == []


def test_the_package_check_sees_an_arrow_back(tmp_path) -> None:
    files = {"sharding/fsdp.py": "from checkpointing.plan import BlockPlan\n",
             "checkpointing/plan.py": "X = 1\n",
             "checkpointing/planner/trace.py": "def f():\n    from sharding.fsdp import g\n",
             "trainer/state/rollback.py": "from trainer.observe.metrics import RunLogger\n",
             "trainer/observe/metrics.py": "from trainer.state.resume import Progress\n",
             "trainer/state/resume.py": "if TYPE_CHECKING:\n    from trainer.observe import x\n",
             "trainer/models/llama.py": "from trainer.config import Config\n",
             "trainer/config.py": "Y = 2\n"}
    _plant(tmp_path, files)
    paths = sorted(tmp_path.rglob("*.py"))
    known = {".".join(p.relative_to(tmp_path).with_suffix("").parts) for p in paths}
    graph = {".".join(p.relative_to(tmp_path).with_suffix("").parts):
             imported_modules(p, known) for p in paths}
    assert package_circles(graph) == [
        "checkpointing <-> sharding: checkpointing.planner.trace -> sharding.fsdp; "
        "sharding.fsdp -> checkpointing.plan",
        "trainer.observe <-> trainer.state: trainer.observe.metrics -> trainer.state.resume; "
        "trainer.state.rollback -> trainer.observe.metrics"]
