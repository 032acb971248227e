#!/usr/bin/env bash
# One command to set up and train, one to set up and test:
#   ./launch/quickstart.sh train [key=value ...]   # python -m trainer with these overrides
#   ./launch/quickstart.sh test  [pytest args ...] # the full test suite (what CI runs)
# Setup is idempotent: a virtual environment (BLOCKTRAIN_VENV, default .venv) with torch and
# blocktrain installed editable with its dev extras. Set BLOCKTRAIN_TORCH to pick another torch.
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

cmd="${1:-}"
shift || true
case "$cmd" in
  train) exec "$py" -m trainer "$@" ;;
  # Two workers, each taking whole test files (module fixtures are computed once); a later
  # `-n N` (or `-n 0`) among the arguments wins.
  test) exec "$py" -m pytest -q -n 2 --dist loadfile "$@" ;;
  *) echo "usage: $0 train [key=value ...] | test [pytest args ...]" >&2; exit 2 ;;
esac
