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


# Which model and which data a run has: tests/test_architecture_questions.py.


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
