"""Every command README quotes beside a figure (an inline `python -m ...`, `pytest ...` or script),
and every one the pages README sends readers to quote (launch/bench/BENCHMARKS.md, the history of
figures; tests/README.md), exists and runs: its module and flags exist, its overrides compose and validate, a pre-flight
report runs as quoted (it is cheap: the meta device), and a benchmark runs its first row on the
tiny model for two steps. So a figure cannot outlive the command that produced it.

(Commands in those pages' code blocks are checked by tests/test_readme_commands.py.)
"""

from __future__ import annotations

import functools
import os
import re
import shlex
import subprocess
import sys

import pytest

from tests.helpers import REPO, subprocess_env
from trainer import cli

# Placeholders mark a command's shape, not a run of it.
PLACEHOLDERS = ("...", "<", "[", "ENTITY", "A,B,C", "=G", " N ", " P ", "OUT")
PAGES = ("README.md", "launch/bench/BENCHMARKS.md", "tests/README.md", "launch/README.md",
         "launch/bench/DATA_BENCHMARKS.md")


def quoted_commands(*pages: str) -> list[str]:
    found = []
    for page in pages:
        found += [c for c in _quoted(page) if c not in found]
    return found


def _quoted(page: str) -> list[str]:
    text = re.sub(r"```.*?```", "", (REPO / page).read_text(), flags=re.S)
    found = []
    for span in re.findall(r"`([^`]+)`", text):
        command = re.sub(r"\s+", " ", span).strip()
        if not re.match(r"(python3? -m \S+ |pytest |\./launch/|\.ci/run)", command + " "):
            continue
        if any(mark in command + " " for mark in PLACEHOLDERS):
            continue
        if command not in found:
            found.append(command)
    return found


COMMANDS = quoted_commands(*PAGES)


def _kinds(commands: list[str]) -> set[str]:
    return {c.split()[2] if c.startswith("python") else c.split()[0] for c in commands}


def test_readme_quotes_figure_commands_of_every_kind() -> None:
    kinds = _kinds(quoted_commands("README.md"))
    assert {"launch.bench", "trainer.report", "trainer", "pytest"} <= kinds, kinds


def test_benchmarks_page_quotes_the_commands_of_its_figures() -> None:
    kinds = _kinds(quoted_commands("launch/bench/BENCHMARKS.md"))
    assert {"launch.bench", "trainer.report", "trainer", "pytest"} <= kinds, kinds


def _run(args: list[str], timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run(args, cwd=REPO, env=subprocess_env(), capture_output=True, text=True,
                          timeout=timeout)


@functools.lru_cache(maxsize=None)
def _help(module: str) -> str:
    helped = _run([sys.executable, "-m", module, "--help"])
    assert helped.returncode == 0, helped.stderr[-2000:]
    return helped.stdout


def _flags_exist(module: str, words: list[str]) -> None:
    for word in words:
        if word.startswith("--"):
            assert word.split("=")[0] in _help(module), f"{module} has no {word}"


def _overrides(words: list[str]) -> list[str]:
    """The Hydra overrides among a command's words (not its flags or their values)."""
    out, skip = [], False
    for word in words:
        if skip:
            skip = False
        elif word.startswith("--"):
            skip = "=" not in word
        elif "=" in word:
            out.append(word)
    return out


BENCH_RUN: set[tuple[str, ...]] = set()
TINY_BENCH = ["train.device=cpu", "data.seq_len=32", "train.micro_batch_size=2",
              "checkpointing.profile_repeats=1"]


def _first_row(words: list[str]) -> list[str]:
    """A benchmark's flags cut to one row of two steps; its overrides to the tiny model's."""
    flags, k = [], 0
    while k < len(words):
        word = words[k]
        value = words[k + 1] if k + 1 < len(words) else ""
        if word in ("--policies", "--targets", "--memory-gib", "--budgets"):
            flags += [word, value.split(",")[0]]
            k += 2
            continue
        if word in ("--steps", "--repeat", "--nproc"):
            k += 2
            continue
        k += 1
    kept = [o for o in _overrides(words)
            if not o.startswith(("model", "data", "train.micro_batch_size", "'model", '"model'))]
    memory = "--memory-gib" in flags  # it sizes the micro-batch, and times after live step 2
    if "--policies" not in flags and "--budgets" not in flags:  # the default set's first row
        flags += ["--policies", "auto" if memory else "none"]
    tiny = [o for o in TINY_BENCH if not (memory and o.startswith("train.micro_batch_size"))]
    return flags + ["--steps", "4" if memory else "2", "--repeat", "1", *kept, *tiny]


@pytest.mark.slow
@pytest.mark.parametrize("command", COMMANDS)
def test_quoted_command_runs(command: str, tmp_path) -> None:
    words = shlex.split(command)
    if words[0] in ("./launch/quickstart.sh", ".ci/run"):
        assert os.access(REPO / words[0], os.X_OK)
        return
    if words[0] == "pytest":  # the test file exists and holds tests
        collected = _run([sys.executable, "-m", "pytest", "--collect-only", "-q",
                          "-p", "no:cacheprovider", *[w for w in words[1:] if w != "-s"]])
        assert collected.returncode == 0, collected.stdout[-2000:]
        assert re.search(r"\d+ tests? collected", collected.stdout), collected.stdout[-2000:]
        return
    module, rest = words[2], words[3:]
    _flags_exist(module, rest)
    if module == "trainer":  # a sweep (-m) is each of its jobs
        jobs = cli.expand_sweep(_overrides(rest)) if "-m" in rest else [_overrides(rest)]
        for job in jobs:
            cli.check(job, {"WORLD_SIZE": "1", "LOCAL_WORLD_SIZE": "1"}, local_gpus=False)
    elif module == "trainer.report":  # meta device: runs as quoted, in seconds
        ran = _run([sys.executable, "-m", "trainer.report", *rest, "--out",
                    str(tmp_path)])
        # 3: the quoted run does not fit (a page may quote one that does not, to say so)
        assert ran.returncode in (0, 3) and "predicted peak" in ran.stdout, ran.stderr[-2000:]
        assert (ran.returncode == 3) == ("does NOT fit" in ran.stdout), ran.stdout[-2000:]
    elif module == "launch.bench.data":  # its three parts, on a small corpus
        ran = _run([sys.executable, "-m", "launch.bench.data", "--text-mb", "0.2", "--chats",
                    "200", "--steps", "5", "--out", str(tmp_path)], timeout=600)
        assert ran.returncode == 0 and "ms/step" in ran.stdout, ran.stderr[-2000:]
    elif module == "launch.bench":
        cli.check(_overrides(rest), {"WORLD_SIZE": "1", "LOCAL_WORLD_SIZE": "1"},
                  local_gpus=False)  # its own overrides, as quoted
        row = _first_row(rest)
        flags = tuple(row[:row.index("--steps")])
        if flags in BENCH_RUN:  # a quoted command of the same mode already ran
            return
        BENCH_RUN.add(flags)
        ran = _run([sys.executable, "-m", "launch.bench", *row], timeout=600)
        assert ran.returncode == 0 and "|---" in ran.stdout, ran.stdout[-2000:] + ran.stderr[
            -2000:]
