#!/usr/bin/env bash
# One command to set up and train, one to set up and test:
#   ./launch/quickstart.sh train [key=value ...]   # python -m trainer with these overrides, in
#                                                  # outputs/quickstart (started again: resumes)
#   ./launch/quickstart.sh test  [pytest args ...] # the full test suite (what CI runs)
# Setup is idempotent: a virtual environment (BLOCKTRAIN_VENV, default .venv) with torch and
# blocktrain installed editable with its dev extras. Set BLOCKTRAIN_TORCH to pick another torch.
# `test` also installs Slurm's packages for the Slurm tests where it can (root with apt-get;
# BLOCKTRAIN_SLURM=0 skips that), and sets up the timm tests' own environment (BLOCKTRAIN_TIMM_VENV, default
# .venv-timm): timm imports torchvision, and PyPI's torchvision is built against PyPI's (CUDA)
# torch, not the CPU build this project pins, so those tests run beside a torch + torchvision
# pair that match (BLOCKTRAIN_TIMM_TORCH). No CPU build of torchvision is on PyPI, so that pair is
# PyPI's CUDA one (~5.6 GB): built by default only where a GPU is visible (or .venv-timm is
# already there); BLOCKTRAIN_TIMM=1 builds it anyway, BLOCKTRAIN_TIMM=0 never. Without it the timm
# tests skip, saying how to enable them.
# The tests run in a random order (pytest-randomly; the seed is printed at the end, and
# --randomly-seed=N repeats an order, -p no:randomly keeps the files' order); -rs lists why each
# skipped test skipped.
set -euo pipefail
cd "$(dirname "$0")/.."
venv="${BLOCKTRAIN_VENV:-.venv}"
torch_spec="${BLOCKTRAIN_TORCH:-torch==2.13.0}"

if [ ! -x "$venv/bin/python" ]; then
  python3 -m venv "$venv"
fi
py="$venv/bin/python"
stamp="$venv/.blocktrain-installed"
if [ ! -f "$stamp" ] || [ pyproject.toml -nt "$stamp" ]; then
  "$py" -m pip install -q --upgrade pip setuptools wheel
  # Install torch first and explicitly: an unpinned torch pulled in as a dependency could be a
  # multi-GB download of another build.
  "$py" -c "import torch" 2>/dev/null || "$py" -m pip install -q "$torch_spec"
  "$py" -m pip install -q -e ".[dev]"
  touch "$stamp"
fi

# The Slurm tests start a real 2-node cluster on this machine (tests/slurm_cluster.py) from
# Debian's packages; installed here where that is possible (root and apt-get), so that a
# newcomer's `test` runs what CI runs. Elsewhere those tests skip, saying which command enables
# them.
setup_slurm() {
  [ "${BLOCKTRAIN_SLURM:-1}" = 0 ] && return 0
  [ -x /usr/sbin/slurmctld ] && return 0
  local packages="slurmctld slurmd munge slurm-client"
  if [ "$(id -u)" != 0 ] || ! command -v apt-get >/dev/null; then
    echo "note: the 3 Slurm tests will skip: they need $packages (as root: apt-get install $packages)" >&2
    return 0
  fi
  echo "installing $packages for the Slurm tests (once)" >&2
  export DEBIAN_FRONTEND=noninteractive
  apt-get install -y -q $packages >/dev/null 2>&1 ||
    { apt-get update -q >/dev/null 2>&1 && apt-get install -y -q $packages >/dev/null 2>&1; } ||
    echo "warning: could not install $packages with apt; the Slurm tests will skip" >&2
}

# The timm tests' environment (tests/test_timm.py runs itself there); a failure only warns.
setup_timm() {
  local want="${BLOCKTRAIN_TIMM:-auto}"
  [ "$want" = 0 ] && return 0
  local tvenv="${BLOCKTRAIN_TIMM_VENV:-$venv-timm}"
  case "$tvenv" in /*) ;; *) tvenv="$PWD/$tvenv" ;; esac
  if [ "$want" != 1 ] && [ ! -x "$tvenv/bin/python" ] && ! nvidia-smi -L >/dev/null 2>&1; then
    echo "note: the timm tests will skip: no GPU here, so their environment (PyPI's CUDA torch +" \
         "torchvision, ~5.6 GB) is not built; BLOCKTRAIN_TIMM=1 ./launch/quickstart.sh test builds it" >&2
    return 0
  fi
  local tspec="${BLOCKTRAIN_TIMM_TORCH:-torch==2.14.1 torchvision==0.29.1}"
  local tstamp="$tvenv/.blocktrain-installed"
  if [ ! -f "$tstamp" ] || [ pyproject.toml -nt "$tstamp" ]; then
    echo "setting up the timm tests' environment in $tvenv ($tspec; once)" >&2
    { [ -x "$tvenv/bin/python" ] || python3 -m venv "$tvenv"; } &&
      "$tvenv/bin/python" -m pip install -q $tspec &&
      "$tvenv/bin/python" -m pip install -q -e ".[timm]" "pytest>=8" &&
      touch "$tstamp" ||
      { echo "warning: could not set up $tvenv; the timm tests will skip" >&2; return 0; }
  fi
  export BLOCKTRAIN_TIMM_PYTHON="$tvenv/bin/python"
}

cmd="${1:-}"
shift || true
case "$cmd" in
  # One run directory for the quick-start job, outputs/quickstart: started again, it resumes
  # from its newest checkpoint (a finished one ends at once). train.run_name=NAME (or
  # hydra.run.dir, or a -m sweep) on the command line chooses another.
  train) run_name=(train.run_name=quickstart)
    for arg in "$@"; do
      case "$arg" in train.run_name=*|hydra.run.dir=*|-m|--multirun) run_name=() ;; esac
    done
    exec "$py" -m trainer ${run_name[@]+"${run_name[@]}"} "$@" ;;
  # Two workers, each taking whole test files (module fixtures are computed once); a later
  # `-n N` (or `-n 0`) among the arguments wins.
  # The tests never reach a W&B server: offline runs are what they read back.
  test) setup_slurm; setup_timm; export WANDB_MODE=offline WANDB_SILENT=true
    exec "$py" -m pytest -q -rs -n 2 --dist loadfile "$@" ;;
  *) echo "usage: $0 train [key=value ...] | test [pytest args ...]" >&2; exit 2 ;;
esac
