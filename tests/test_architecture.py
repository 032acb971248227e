"""The folders are the architecture, and the arrows point one way: `launch/` may use everything,
`trainer/` composes `checkpointing/`, `offload/` and `sharding/`, and those three never import
anything above them (nor `launch/`), not even inside a function."""

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


def test_the_room_check_sees_a_planted_import(tmp_path) -> None:
    files = {"checkpointing/wrap.py": "def f():\n    from checkpointing.planner.search import x\n",
             "checkpointing/head.py": "from . import planner\n",
             "checkpointing/planner/memory.py": "from checkpointing.planner import search\n"
                                                "from .search import y\n",
             "offload/apply.py": "if TYPE_CHECKING:\n    import checkpointing.planner.profile\n",
             "sharding/fsdp.py": "from checkpointing.plan import BlockPlan\n",
             "trainer/loop.py": "def g():\n    from launch.bench import plain\n",
             "launch/gpu_bench.py": "from launch.bench.plain import main\n"}
    for name, text in files.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(text)
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


def long_functions(path, limit: int = 80) -> list[str]:
    return [f"{path.name}:{node.lineno} {node.name} is {node.end_lineno - node.lineno + 1} lines"
            for node in ast.walk(ast.parse(path.read_text(), filename=str(path)))
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))
            and node.end_lineno - node.lineno + 1 > limit]


def test_no_function_over_80_lines_and_no_file_over_400() -> None:
    paths = [p for folder in PROJECT for p in sorted((REPO / folder).rglob("*.py"))]
    assert [f for p in paths for f in long_functions(p)] == []
    assert [p.name for p in paths if len(p.read_text().splitlines()) >= 400] == []


def test_the_length_check_sees_a_long_function(tmp_path) -> None:
    sample = tmp_path / "x.py"
    sample.write_text("def f():\n" + "    x = 1\n" * 80 + "\n\ndef g():\n    pass\n")
    assert long_functions(sample) == ["x.py:1 f is 81 lines"]


def test_the_step_loop_fits_on_a_screen() -> None:
    """The body of the step loop: one line per part, at most 40 lines."""
    tree = ast.parse((REPO / "trainer" / "loop.py").read_text())
    steps = next(n for n in ast.walk(tree) if isinstance(n, ast.FunctionDef) and n.name == "_steps")
    loops = [n for n in ast.walk(steps) if isinstance(n, ast.While)]
    assert len(loops) == 1 and loops[0].end_lineno - loops[0].lineno <= 40


# Only the model families (and their registry) look at `model.arch`: everything else asks the
# family, so adding one is its module, its YAML and its tests.
FAMILY_HOME = REPO / "trainer" / "models" / "families"


def _reads_arch(node: ast.AST) -> bool:
    """`x.arch`, `x.get("arch")` or `x["arch"]`."""
    if isinstance(node, ast.Attribute):
        return node.attr == "arch"
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
        return (node.func.attr == "get" and bool(node.args)
                and isinstance(node.args[0], ast.Constant) and node.args[0].value == "arch")
    return (isinstance(node, ast.Subscript) and isinstance(node.slice, ast.Constant)
            and node.slice.value == "arch")


def arch_tests(path) -> list[int]:
    """The lines where a file decides by the arch: a comparison, a match or a table lookup on
    it, or the old list of image architectures."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Compare):
            hit = any(_reads_arch(n) for n in (node.left, *node.comparators))
        elif isinstance(node, ast.Match):
            hit = _reads_arch(node.subject)
        elif isinstance(node, ast.Subscript):
            hit = _reads_arch(node.slice)
        else:
            hit = (isinstance(node, ast.Name) and node.id == "IMAGE_ARCHS"
                   or isinstance(node, ast.Attribute) and node.attr == "IMAGE_ARCHS")
        if hit:
            found.append(node.lineno)
    return sorted(found)


def test_only_the_model_families_look_at_the_arch() -> None:
    paths = [p for folder in PROJECT for p in sorted((REPO / folder).rglob("*.py"))
             if FAMILY_HOME not in p.parents]
    assert [f"{p.relative_to(REPO)}:{line}" for p in paths for line in arch_tests(p)] == []


def test_the_arch_check_sees_each_way_of_deciding(tmp_path) -> None:
    sample = tmp_path / "x.py"
    sample.write_text("if cfg.model.arch == 'hf':\n    pass\nimage = m.arch in IMAGE_ARCHS\n"
                      "same = saved.get('arch') != 'vit'\nmatch m.arch:\n    case 'vit':\n"
                      "        pass\nbuild = TABLE[m.arch]\nname = f'{m.arch}'\n"
                      "family = family_of(cfg.model)\n")
    assert arch_tests(sample) == [1, 3, 3, 4, 5, 8]


# Which kind of data a run reads is asked in one place: trainer/data/factory.py turns
# data.source and data.streaming into a source object, and the rest asks that object.
DATA_ROOM = "trainer/data"
KIND_NAMES = {"DOCUMENT_SOURCES", "IMAGE_SOURCES"}


def _is_kind_value(node: ast.AST) -> bool:
    """A source's name ("tokens"), a tuple of them, or a *_SOURCES list."""
    if isinstance(node, ast.Constant):
        return isinstance(node.value, str)
    if isinstance(node, (ast.Tuple, ast.List, ast.Set)):
        return bool(node.elts) and all(_is_kind_value(e) for e in node.elts)
    name = node.id if isinstance(node, ast.Name) else getattr(node, "attr", "")
    return name.endswith("_SOURCES")


def data_kind_tests(path) -> list[str]:
    """`x.source ==/in <a source's name>`, any `data.source` or `.streaming`, and the
    *_SOURCES lists: where a file asks which data a run reads."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        what = None
        if isinstance(node, ast.Compare):
            sides = [node.left, *node.comparators]
            if any(isinstance(s, ast.Attribute) and s.attr == "source" for s in sides) and any(
                    _is_kind_value(s) for s in sides):
                what = "compares .source"
        elif isinstance(node, ast.Attribute) and node.attr == "streaming":
            what = "reads .streaming"
        elif isinstance(node, ast.Attribute) and node.attr == "source" and (
                isinstance(node.value, ast.Name) and node.value.id == "data"
                or isinstance(node.value, ast.Attribute) and node.value.attr == "data"):
            what = "reads data.source"
        elif isinstance(node, (ast.Name, ast.Attribute)) and (
                getattr(node, "id", None) in KIND_NAMES or getattr(node, "attr", None)
                in KIND_NAMES):
            what = "names a list of sources"
        if what:
            found.append((node.lineno, what))
    return [f"{path.name}:{line} {what}" for line, what in sorted(set(found))]


def test_only_the_data_sources_ask_which_data_a_run_reads() -> None:
    paths = [p for folder in PROJECT for p in sorted((REPO / folder).rglob("*.py"))
             if not p.relative_to(REPO).as_posix().startswith(DATA_ROOM + "/")]
    assert [f for p in paths for f in data_kind_tests(p)] == []


def test_the_data_kind_check_sees_a_comparison(tmp_path) -> None:
    sample = tmp_path / "x.py"
    sample.write_text("def f(cfg, d, ticket):\n"
                      "    if cfg.data.source == 'tokens':\n"
                      "        pass\n"
                      "    share = 1 if d.streaming else None\n"
                      "    kinds = IMAGE_SOURCES\n"
                      "    run(data.source)\n"
                      "    if d.source in ('text', 'chat'):\n"
                      "        pass\n"
                      "    return ticket.source is not None\n")  # not a data source: fine
    assert data_kind_tests(sample) == [
        "x.py:2 compares .source", "x.py:2 reads data.source", "x.py:4 reads .streaming",
        "x.py:5 names a list of sources", "x.py:6 reads data.source", "x.py:7 compares .source"]


# The Trainer's parts are whole when made: every attribute is first set in __init__, so no
# method can meet a part that does not exist yet.
def late_attributes(source: str, cls: str = "Trainer") -> list[str]:
    """`self.X = ...` in a method of `cls` other than __init__, where __init__ never sets X."""
    tree = ast.parse(source)
    klass = next(n for n in ast.walk(tree) if isinstance(n, ast.ClassDef) and n.name == cls)
    methods = [n for n in klass.body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))]

    def assigned(method) -> list[tuple[str, int]]:
        targets = []
        for node in ast.walk(method):
            if isinstance(node, (ast.Assign, ast.AugAssign, ast.AnnAssign)):
                for target in node.targets if isinstance(node, ast.Assign) else [node.target]:
                    for t in ast.walk(target):  # tuples: self.a, self.b = ...
                        if (isinstance(t, ast.Attribute) and isinstance(t.value, ast.Name)
                                and t.value.id == "self" and isinstance(t.ctx, ast.Store)):
                            targets.append((t.attr, t.lineno))
        return targets

    made = {name for m in methods if m.name == "__init__" for name, _ in assigned(m)}
    return [f"{m.name}:{line} sets self.{name}" for m in methods if m.name != "__init__"
            for name, line in assigned(m) if name not in made]


def test_every_trainer_attribute_is_made_in_init() -> None:
    assert late_attributes((REPO / "trainer" / "loop.py").read_text()) == []


def test_the_attribute_check_sees_a_late_part() -> None:
    source = ("class Trainer:\n"
              "    def __init__(self):\n"
              "        self.a, self.b = 1, 2\n"
              "    def run(self):\n"
              "        self.a = 3\n"
              "        self.b += 1\n"
              "        self.a.field = 4\n"
              "        self.late, self.b = 5, 6\n")
    assert late_attributes(source) == ["run:8 sets self.late"]
