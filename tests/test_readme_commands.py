"""Every trainer, Slurm and report command in the code blocks of README and of the pages it sends
readers to (tests/README.md, launch/bench/BENCHMARKS.md) composes and validates (no training),
and every error they show is the error that command gives, word for word."""

from __future__ import annotations

import io
import os
import shlex
from contextlib import redirect_stderr

import pytest

from tests.helpers import REPO
from trainer import cli
from trainer.config import ConfigError

# Settings that name files on the user's machine (README's /data/pets, data/mine/...): their
# absence here is no mistake in the command.
PATH_KEYS = ("data.train_path", "data.val_path", "model.path", "save.dir", "offload.dir",
             "model.checkpoint_path", "model.name",  # model.name=local-dir:<folder> (timm)
             "data.path", "data.tokenizer")
TOOLS = {"-m trainer": "trainer", "-m launch.slurm": "slurm", "-m trainer.report": "report"}
# README and the pages that took over its test catalogue and its history of figures.
PAGES = ("README.md", "tests/README.md", "launch/bench/BENCHMARKS.md", "launch/README.md",
         "launch/bench/DATA_BENCHMARKS.md")


def readme_commands(page: str = "README.md") -> list[tuple[int, str, str | None]]:
    """(line, command, the error the page shows after it or None), continuation lines joined."""
    lines = (REPO / page).read_text().splitlines()
    found, in_block, i = [], False, 0
    while i < len(lines):
        line = lines[i]
        if line.startswith("```"):
            in_block = not in_block
        elif in_block and any(tool + " " in line + " " for tool in TOOLS):
            start, command = i + 1, line
            while command.rstrip().endswith("\\"):
                i += 1
                command = command.rstrip()[:-1] + " " + lines[i].strip()
            shown = lines[i + 1] if i + 1 < len(lines) else ""
            found.append((start, command, shown if shown.startswith("error:") else None))
        i += 1
    return found


def parse(command: str) -> tuple[str, list[list[str]], dict[str, str]]:
    """The tool, its jobs' overrides (a sweep gives several) and the world it would have."""
    words = [w for w in shlex.split(command.removeprefix("$ "), comments=True)
             if w not in ("...",) and not (w.startswith("[") or w.endswith("]"))]
    for k in range(len(words) - 1, -1, -1):  # Hydra's flags that take a value: not overrides
        if words[k] in ("--cfg", "-c", "--package", "-p", "--info", "-i"):
            del words[k:k + 2]
    text = " ".join(words)
    tool = next(name for flag, name in TOOLS.items() if flag + " " in text + " ")
    module = words.index(next(w for w in words if w in ("trainer", "launch.slurm",
                                                        "trainer.report")))
    before, after = words[:module], words[module + 1:]

    def flag(names: tuple[str, ...], default: int) -> int:
        for k, w in enumerate(words):
            if w in names:
                return int(words[k + 1])
            for name in names:
                if w.startswith(name + "="):
                    return int(w.split("=", 1)[1])
        return default

    if tool == "slurm":
        nodes, gpus = flag(("--nodes",), 1), flag(("--gpus-per-node",), 1)
        overrides = after[after.index("--") + 1:] if "--" in after else []
        world, local = nodes * max(1, gpus), max(1, gpus)
    elif tool == "report":
        world, nodes = flag(("--world-size",), 1), flag(("--nodes",), 1)
        overrides = [w for w in after if "=" in w and not w.startswith("-")]
        local = world // nodes
    else:
        per_node = flag(("--nproc-per-node",), 1) if "torchrun" in before else 1
        world, local = per_node * flag(("--nnodes",), 1), per_node
        overrides = [w for w in after if not w.startswith("-")]
    jobs = cli.expand_sweep(overrides) if "-m" in after else [overrides]
    return tool, jobs, {"WORLD_SIZE": str(world), "LOCAL_WORLD_SIZE": str(local)}


COMMANDS = readme_commands()
PAGE_COMMANDS = [(page, *found) for page in PAGES for found in readme_commands(page)]


def test_readme_has_the_commands_this_test_reads() -> None:
    tools = {parse(c)[0] for _, c, _ in COMMANDS}
    assert tools == set(TOOLS.values()) and len(COMMANDS) >= 15


@pytest.mark.parametrize("page,line,command,shown", PAGE_COMMANDS,
                         ids=[f"{page}:L{n}" for page, n, _, _ in PAGE_COMMANDS])
def test_readme_command_validates(page: str, line: int, command: str, shown: str | None) -> None:
    tool, jobs, env = parse(command)
    if shown is not None:  # README shows this command failing: it must fail exactly so
        if tool == "slurm":
            pytest.skip("the Slurm error shown depends on the cluster it runs against")
        err = io.StringIO()
        with redirect_stderr(err):
            status = cli.check_command(jobs[0], env)
        printed = err.getvalue().strip()
        assert status == 2, printed
        if shown.endswith("(...)"):  # README cut the rest of the line
            assert printed.startswith(shown[:-len("(...)")].rstrip()), printed
        else:
            assert printed == shown, printed
        return
    for job in jobs:
        try:
            cli.check(job, env, local_gpus=False)
        except ConfigError as exc:
            value = next((o.split("=", 1)[1].removeprefix("local-dir:") for o in job
                          if o.startswith(exc.key + "=")), None)
            missing_file = exc.key in PATH_KEYS and value and not os.path.exists(value)
            # model=timm validates by building the timm model, which needs timm importable
            # (tests/test_timm.py runs where it is).
            no_timm = exc.key == "model.arch" and "timm needs the timm package" in str(exc)
            assert missing_file or no_timm, f"{page} line {line}: {command}\n  -> {exc}"
