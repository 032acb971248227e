#!/usr/bin/env bash
# One command to set up and train, one to set up and test:
#   ./launch/quickstart.sh train [key=value ...]   # python -m trainer with these overrides
#   ./launch/quickstart.sh test  [pytest args ...] # the full test suite (what CI runs)
# Setup is idempotent: a virtual environment (BLOCKTRAIN_VENV, default .venv) with torch and
# blocktrain installed editable with its dev extras. Set BLOCKTRAIN_TORCH to pick another torch.
# `test` also sets up the timm tests' own environment (BLOCKTRAIN_TIMM_VENV, default
# .venv-timm): timm imports torchvision, and PyPI's torchvision is built against PyPI's (CUDA)
# torch, not the CPU build this project pins, so those tests run beside a torch + torchvision
# pair that match (BLOCKTRAIN_TIMM_TORCH). BLOCKTRAIN_TIMM=0 skips it; the timm tests then skip,
# saying so.
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

# The timm tests' environment (tests/test_timm.py runs itself there); a failure only warns.
setup_timm() {
  [ "${BLOCKTRAIN_TIMM:-1}" = 0 ] && return 0
  local tvenv="${BLOCKTRAIN_TIMM_VENV:-$venv-timm}"
  case "$tvenv" in /*) ;; *) tvenv="$PWD/$tvenv" ;; esac
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
  train) exec "$py" -m trainer "$@" ;;
  # Two workers, each taking whole test files (module fixtures are computed once); a later
  # `-n N` (or `-n 0`) among the arguments wins.
  test) setup_timm; exec "$py" -m pytest -q -n 2 --dist loadfile "$@" ;;
  *) echo "usage: $0 train [key=value ...] | test [pytest args ...]" >&2; exit 2 ;;
esac
