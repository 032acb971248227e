"""Environment defaults for multi-node runs on NCCL clusters: the one place they are set.

The Slurm job script (launch/train.sbatch, and what `python -m launch.slurm` writes) exports
these; with plain torchrun, `eval "$(python -m launch.cluster_env)"` on each node does the same.
Every value is a default: a variable already set in the environment (e.g. exported before
`sbatch`, which passes the submitting shell's environment on) wins, and `--env KEY=VALUE` on the
generator replaces a default outright. `${RUN_DIR}` is expanded by the job script.
"""

from __future__ import annotations

import sys
from typing import Mapping



def _flight_recorder_names() -> tuple[str, str]:
    """(buffer size, dump file) variable names the installed torch reads without a warning:
    torch 2.8 renamed TORCH_NCCL_TRACE_BUFFER_SIZE / TORCH_NCCL_DEBUG_INFO_TEMP_FILE to
    TORCH_FR_BUFFER_SIZE / TORCH_FR_DUMP_TEMP_FILE and warns on the old names (twice per run)."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        major, minor = (int(part) for part in version("torch").split(".")[:2])
    except (PackageNotFoundError, ValueError):
        major, minor = 2, 11  # what the project needs at least
    if (major, minor) >= (2, 8):
        return "TORCH_FR_BUFFER_SIZE", "TORCH_FR_DUMP_TEMP_FILE"
    return "TORCH_NCCL_TRACE_BUFFER_SIZE", "TORCH_NCCL_DEBUG_INFO_TEMP_FILE"


FR_BUFFER_SIZE, FR_DUMP_FILE = _flight_recorder_names()
# name -> (value, why)
DEFAULTS: dict[str, tuple[str, str]] = {
    "TORCH_NCCL_ASYNC_ERROR_HANDLING": (
        "3", "a NCCL error or timeout ends the process, so srun --kill-on-bad-exit ends the job "
             "instead of leaving it hung (pinned: older torch defaulted to other modes)"),
    "TORCH_NCCL_DUMP_ON_TIMEOUT": (
        "1", "on a collective timeout each rank dumps its flight recorder, naming the collective "
             "it was stuck in"),
    FR_BUFFER_SIZE: (
        "20000", "flight recorder entries kept per rank (needed by TORCH_NCCL_DUMP_ON_TIMEOUT)"),
    FR_DUMP_FILE: (
        "${RUN_DIR}/nccl_trace_rank_", "flight recorder dumps go to the run directory, one "
                                       "file per rank"),
    "PYTORCH_CUDA_ALLOC_CONF": (
        "expandable_segments:True", "fewer fragmentation OOMs when FSDP's all-gather buffers "
                                    "and activations vary in size step to step"),
    "NCCL_DEBUG": ("WARN", "NCCL prints problems, not its whole topology on every rank"),
    "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": (
        "1", "torchrun restarts with the c10d rendezvous re-read the previous attempt's gloo "
             "addresses and failed to connect (pytorch#135712; seen here)"),
    "PYTHONUNBUFFERED": ("1", "log lines reach the job's output file as they are printed"),
}


def merged(overrides: Mapping[str, str]) -> dict[str, str]:
    """The defaults with `overrides` (KEY -> VALUE) replacing or adding entries."""
    values = {name: value for name, (value, _) in DEFAULTS.items()}
    values.update(overrides)
    return values


def _shell_value(value: str) -> str:
    """Double-quoted, so `${RUN_DIR}` still expands; other shell syntax is escaped."""
    escaped = value.replace("\\", "\\\\").replace('"', '\\"').replace("`", "\\`")
    return '"' + escaped.replace("$", "\\$").replace("\\${RUN_DIR}", "${RUN_DIR}") + '"'


def export_lines(values: Mapping[str, str], forced: Mapping[str, str] = {}) -> list[str]:
    """`export NAME="${NAME:-value}"` (the environment wins), or `export NAME="value"` for the
    names in `forced` (given on the generator's command line: the user asked for exactly it)."""
    lines = []
    for name, value in values.items():
        if name in forced:
            lines.append(f"export {name}={_shell_value(value)}")
        else:
            lines.append(f'export {name}="${{{name}:-{_shell_value(value)[1:-1]}}}"')
    return lines


def parse_assignments(pairs: list[str]) -> dict[str, str]:
    """`KEY=VALUE` strings (from --env) to a dict; a malformed one is a usage error."""
    out = {}
    for pair in pairs:
        name, sep, value = pair.partition("=")
        if not sep or not name.isidentifier():
            raise ValueError(f"--env {pair}: expected NAME=VALUE")
        out[name] = value
    return out


def main(argv: list[str]) -> int:
    """Print the export lines for a shell to eval; RUN_DIR defaults to the current folder."""
    print('RUN_DIR="${RUN_DIR:-$PWD}"')
    for line in export_lines(merged(parse_assignments(argv))):
        print(line)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
