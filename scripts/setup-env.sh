#!/usr/bin/env bash
# Creates (or refreshes) the project's virtual environment in .venv with the given extras.
# Usage: scripts/setup-env.sh EXTRAS   e.g. scripts/setup-env.sh serve,generate,test
# Re-installs only when pyproject.toml or the extras change, so repeated runs are fast.
set -euo pipefail
cd "$(dirname "$0")/.."
extras="${1:?usage: setup-env.sh EXTRAS}"
python="${PYTHON:-python3}"
stamp=".venv/.layerwatch-installed"
want="$(sha256sum pyproject.toml | cut -d' ' -f1) $extras"

if [ ! -x .venv/bin/python ]; then
  "$python" -m venv .venv
fi
if [ ! -f "$stamp" ] || [ "$(cat "$stamp")" != "$want" ]; then
  .venv/bin/python -m pip install --quiet --upgrade pip
  # torch is pinned in pyproject (==2.13.0, the CPU wheel); nothing here may pull a CUDA build.
  .venv/bin/python -m pip install --quiet -e ".[$extras]"
  echo "$want" > "$stamp"
fi
