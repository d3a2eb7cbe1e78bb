#!/usr/bin/env bash
# The demo: the shim on the embedded demo model, the exporter, a load generator, Prometheus and
# Alertmanager when installed, and the live entropy histogram. Ctrl-C stops everything.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup-env.sh
exec .venv/bin/layerwatch demo "$@"
