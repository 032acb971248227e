"""Questions about which model or which data a run has are asked in their homes only: the model
families (trainer/models/families/) and the data sources (trainer/data/). Everything else asks
the family, its task or the source object, so adding a model or a source is its own module, its
YAML and its tests (issue 43 item 2).

Every way of asking is looked for, each with a planted sample below proving the check sees it:
reading `arch` to decide, the `language_model` flag, comparing a `.kind`, `isinstance` on a
model class, comparing with a model's name ("llama", "qwen3_8b"), importing a model module from
the trainer; and for data: comparing `.source`, reading `data.source` or `.streaming`, naming or
spelling out a list of source names."""

from __future__ import annotations

import ast

from tests.helpers import REPO
from trainer.data.factory import KINDS
from trainer.models.families import FAMILIES

PROJECT = ("trainer", "checkpointing", "offload", "sharding", "launch")
FAMILY_HOME = "trainer/models/families/"
MODEL_ROOM = "trainer/models/"
DATA_ROOM = "trainer/data/"
# The benchmarks compare a named model with its plain-PyTorch reference: choosing which of
# their own models to run is their job (launch/bench/reference.py's --model llama|hf).
BENCH_ROOM = "launch/bench/"
MODEL_NAMES = set(FAMILIES) | {p.stem for p in (REPO / "conf" / "model").glob("*.yaml")}
SOURCE_NAMES = set(KINDS)


def model_classes() -> set[str]:
    """The classes the model modules define (not the families, which may ask of them)."""
    return {node.name for path in (REPO / "trainer" / "models").glob("*.py")
            for node in ast.walk(ast.parse(path.read_text())) if isinstance(node, ast.ClassDef)}


def _rel(path) -> str:
    return path.relative_to(REPO).as_posix()


def _reads_arch(node: ast.AST) -> bool:
    """`x.arch`, `x.get("arch")` or `x["arch"]`."""
    if isinstance(node, ast.Attribute):
        return node.attr == "arch"
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
        return (node.func.attr == "get" and bool(node.args)
                and isinstance(node.args[0], ast.Constant) and node.args[0].value == "arch")
    return (isinstance(node, ast.Subscript) and isinstance(node.slice, ast.Constant)
            and node.slice.value == "arch")


def _names(node: ast.AST) -> set[str]:
    """String constants of a node: itself, or a tuple/list/set of them."""
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return {node.value}
    if isinstance(node, (ast.Tuple, ast.List, ast.Set)):
        return set().union(*(_names(e) for e in node.elts)) if node.elts else set()
    return set()


def _class_names(node: ast.AST) -> set[str]:
    if isinstance(node, ast.Tuple):
        return set().union(*(_class_names(e) for e in node.elts)) if node.elts else set()
    if isinstance(node, ast.Name):
        return {node.id}
    return {node.attr} if isinstance(node, ast.Attribute) else set()


def _is_kind(node: ast.AST) -> bool:
    return isinstance(node, ast.Attribute) and node.attr == "kind"


def model_questions(source: str, classes: set[str], names: set[str] = MODEL_NAMES,
                    trainer_file: bool = True, kinds: bool = True) -> list[str]:
    """'line: what' for each place a file asks which model it has (`kinds`: a compared `.kind`
    counts; the data sources compare their documents' kinds, text or chat)."""
    found = set()
    for node in ast.walk(ast.parse(source)):
        what = None
        if isinstance(node, ast.Compare):
            sides = [node.left, *node.comparators]
            if any(_reads_arch(s) for s in sides):
                what = "compares the arch"
            elif kinds and any(_is_kind(s) for s in sides):
                what = "compares a .kind"
            elif any(_names(s) & names for s in sides):
                what = "compares with a model's name"
        elif isinstance(node, ast.Match):
            what = ("matches the arch" if _reads_arch(node.subject) else
                    "matches a .kind" if kinds and _is_kind(node.subject) else None)
        elif isinstance(node, ast.Subscript) and _reads_arch(node.slice):
            what = "looks the arch up"
        elif isinstance(node, ast.Attribute) and node.attr == "language_model":
            what = "reads language_model"
        elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
              and node.func.id in ("isinstance", "issubclass") and len(node.args) == 2
              and _class_names(node.args[1]) & classes):
            what = f"{node.func.id} on a model class"
        elif trainer_file and isinstance(node, ast.ImportFrom) and node.module and (
                node.module.startswith("trainer.models.")
                and not node.module.startswith("trainer.models.families")
                or node.module == "trainer.models"
                and any(a.name != "families" for a in node.names)):
            what = f"imports {node.module}"
        elif trainer_file and isinstance(node, ast.Import) and any(
                a.name.startswith("trainer.models.")
                and not a.name.startswith("trainer.models.families") for a in node.names):
            what = "imports a model module"
        if what:
            found.add((node.lineno, what))
    return [f"{line}: {what}" for line, what in sorted(found)]


def test_only_the_families_ask_which_model_a_run_has() -> None:
    classes = model_classes()
    wrong = []
    for folder in PROJECT:
        for path in sorted((REPO / folder).rglob("*.py")):
            rel = _rel(path)
            if rel.startswith(FAMILY_HOME):
                continue
            in_models = rel.startswith(MODEL_ROOM)
            # A model module may name its own classes and import its parts; a benchmark may
            # choose which of its models to run.
            found = model_questions(path.read_text(), set() if in_models else classes,
                                    set() if rel.startswith(BENCH_ROOM) else MODEL_NAMES,
                                    trainer_file=rel.startswith("trainer/") and not in_models,
                                    kinds=not rel.startswith(DATA_ROOM))
            wrong += [f"{rel}:{f}" for f in found]
    assert wrong == []


def test_the_model_check_sees_each_way_of_asking() -> None:
    sample = ("from trainer.models.llama import lm_loss\n"                      # 1
              "import trainer.models.vit\n"                                     # 2
              "from trainer.models.families import family_of\n"                 # 3: fine
              "if cfg.model.arch == 'hf':\n    pass\n"                          # 4
              "same = saved.get('arch') != 'vit'\n"                             # 6
              "match m.arch:\n    case 'vit':\n        pass\n"                  # 7
              "build = TABLE[m.arch]\n"                                         # 10
              "text = family.language_model\n"                                  # 11
              "if task.kind == 'classification':\n    pass\n"                   # 12
              "ok = isinstance(model, Llama)\n"                                 # 14
              "ok = isinstance(block, (nn.Linear, llama.Block))\n"              # 15
              "big = m.name in ('qwen3_8b', 'other')\n"                         # 16
              "if name == 'llama':\n    pass\n"                                 # 17
              "ok = isinstance(x, int)\n"                                       # 19: fine
              "name = f'{m.arch}'\n"                                            # 20: fine
              "family = family_of(cfg.model)\n")                                # 21: fine
    assert model_questions(sample, {"Llama", "Block"}) == [
        "1: imports trainer.models.llama", "2: imports a model module", "4: compares the arch",
        "6: compares the arch", "7: matches the arch", "10: looks the arch up",
        "11: reads language_model", "12: compares a .kind", "14: isinstance on a model class",
        "15: isinstance on a model class", "16: compares with a model's name",
        "17: compares with a model's name"]
    # Outside the trainer (a benchmark, a lower package's own test), imports are not asked.
    assert model_questions("from trainer.models.llama import Llama\n", set(),
                           trainer_file=False) == []


def test_the_model_names_and_classes_are_the_real_ones() -> None:
    """The check looks for the names and classes that exist, so it cannot pass by looking for
    none."""
    assert {"llama", "qwen3", "hf", "vit", "tiny", "qwen3_32b"} <= MODEL_NAMES
    assert {"Llama", "Qwen3", "Block", "Attention", "ViT"} <= model_classes()


# Which kind of data a run reads is asked in one place: trainer/data/factory.py turns
# data.source and data.streaming into a source object, and the rest asks that object.
KIND_NAMES = {"DOCUMENT_SOURCES", "IMAGE_SOURCES", "SOURCES"}


def _is_kind_value(node: ast.AST) -> bool:
    """A source's name ("tokens"), a tuple of them, or a *_SOURCES list."""
    if isinstance(node, ast.Constant):
        return isinstance(node.value, str)
    if isinstance(node, (ast.Tuple, ast.List, ast.Set)):
        return bool(node.elts) and all(_is_kind_value(e) for e in node.elts)
    name = node.id if isinstance(node, ast.Name) else getattr(node, "attr", "")
    return name.endswith("SOURCES")


def _source_list(node: ast.AST) -> bool:
    """A literal collection (or dict's keys) of two or more source names."""
    if isinstance(node, ast.Dict):
        keys = [k for k in node.keys if k is not None]
        return len(_names(ast.Tuple(elts=keys)) & SOURCE_NAMES) >= 2
    return isinstance(node, (ast.Tuple, ast.List, ast.Set)) and len(_names(node)
                                                                     & SOURCE_NAMES) >= 2


def data_kind_tests(source: str, lists: bool = True) -> list[str]:
    """'line: what' where a file asks which data a run reads (`lists`: spelling out source
    names counts; a benchmark names its own rows)."""
    found = set()
    for node in ast.walk(ast.parse(source)):
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
        elif lists and _source_list(node):
            what = "lists source names"
        if what:
            found.add((node.lineno, what))
    return [f"{line}: {what}" for line, what in sorted(found)]


def test_only_the_data_sources_ask_which_data_a_run_reads() -> None:
    paths = [p for folder in PROJECT for p in sorted((REPO / folder).rglob("*.py"))
             if not _rel(p).startswith(DATA_ROOM)]
    assert [f"{_rel(p)}:{f}" for p in paths for f in data_kind_tests(
        p.read_text(), lists=not _rel(p).startswith(BENCH_ROOM))] == []


def test_the_source_names_are_listed_once() -> None:
    """One list of source names, the factory's; the rest of trainer/data/ names one source at a
    time (a source object's own name)."""
    lists = [f"{_rel(p)}:{node.lineno}" for p in sorted((REPO / DATA_ROOM).rglob("*.py"))
             for node in ast.walk(ast.parse(p.read_text())) if _source_list(node)]
    assert len(lists) == 1 and lists[0].startswith("trainer/data/factory.py:"), lists


def test_the_data_kind_check_sees_each_way_of_asking() -> None:
    sample = ("def f(cfg, d, ticket):\n"
              "    if cfg.data.source == 'tokens':\n"                           # 2
              "        pass\n"
              "    share = 1 if d.streaming else None\n"                         # 4
              "    kinds = IMAGE_SOURCES\n"                                      # 5
              "    run(data.source)\n"                                           # 6
              "    if d.source in ('text', 'chat'):\n"                           # 7
              "        pass\n"
              "    names = ['bytes', 'images', 'other']\n"                       # 9
              "    table = {'chat': 1, 'synthetic': 2}\n"                        # 10
              "    one = {'chat': 1}\n"                                          # 11: fine
              "    return ticket.source is not None\n")                          # 12: fine
    assert data_kind_tests(sample) == [
        "2: compares .source", "2: reads data.source", "4: reads .streaming",
        "5: names a list of sources", "6: reads data.source", "7: compares .source",
        "7: lists source names", "9: lists source names", "10: lists source names"]
