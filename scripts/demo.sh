#!/usr/bin/env bash
# The demo: the shim on the embedded demo model, the exporter, a load generator, Prometheus and
# Alertmanager (installed here on first use, as the test command installs them: root or sudo), and
# the live entropy histogram with the alert state beside it. `scripts/demo.sh --drill static`
# injects a fault after a healthy baseline and shows its page. Ctrl-C stops everything.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup-env.sh
if ! command -v prometheus >/dev/null || ! command -v prometheus-alertmanager >/dev/null; then
  if [ "$(id -u)" -eq 0 ] || sudo -n true 2>/dev/null; then
    scripts/install-system-deps.sh --demo
  else
    echo "demo: Prometheus and Alertmanager are not installed, and installing them needs root or sudo" \
      "(sudo -n true failed). Running the reduced demo: no rule is evaluated, no alert can fire, no drill." \
      "For the whole demo run 'sudo scripts/install-system-deps.sh --demo' once, then scripts/demo.sh again." >&2
  fi
fi
exec .venv/bin/layerwatch demo "$@"
