#!/usr/bin/env bash
# The test command: installs what the tests need (Debian packages, the venv) and runs the suite.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/install-system-deps.sh
scripts/setup-env.sh
.venv/bin/layerwatch generate --check
exec .venv/bin/python -m pytest "$@"
