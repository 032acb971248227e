"""The house rules that are not import arrows (those are tests/test_arrows.py's): no function
over 80 lines and no file over 400, a step loop that fits on a screen, model-kind and data-kind
questions asked only at their homes, and every Trainer attribute made in __init__."""

from __future__ import annotations

import ast

from tests.helpers import REPO

PROJECT = ("trainer", "checkpointing", "offload", "sharding", "launch")


def long_functions(path, limit: int = 80) -> list[str]:
    return [f"{path.name}:{node.lineno} {node.name} is {node.end_lineno - node.lineno + 1} lines"
            for node in ast.walk(ast.parse(path.read_text(), filename=str(path)))
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))
            and node.end_lineno - node.lineno + 1 > limit]


def test_no_function_over_80_lines_and_no_file_over_400() -> None:
    paths = [p for folder in (*PROJECT, "tests") for p in sorted((REPO / folder).rglob("*.py"))]
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
