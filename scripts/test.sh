#!/usr/bin/env bash
# The test command: installs what the tests need (Debian packages, the venv), runs the generators'
# check, the linter, the formatter's check and the type checker, then the suite.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/install-system-deps.sh
scripts/setup-env.sh
scripts/setup-aiperf.sh
scripts/setup-vllm.sh
.venv/bin/layerwatch generate --check
.venv/bin/ruff check .
.venv/bin/ruff format --check .
.venv/bin/mypy
exec .venv/bin/python -m pytest "$@"
