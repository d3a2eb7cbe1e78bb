#!/usr/bin/env bash
# The demo: the shim on the embedded demo model, the exporter, a load generator, Prometheus and
# Alertmanager (installed here on first use, as the test command installs them: root or sudo), and
# the live entropy histogram with the alert state beside it. `scripts/demo.sh --drill static`
# injects a fault after a healthy baseline and shows its page. `scripts/demo.sh --engine vllm` serves
# SmolLM2 through `vllm serve` with layerwatch's plugin instead. Ctrl-C stops everything.
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
# --engine vllm serves the model through `vllm serve`, which needs its own environment, .venv-vllm.
previous=""
for arg in "$@"; do
  if [ "$previous $arg" = "--engine vllm" ] || [ "$arg" = "--engine=vllm" ]; then
    scripts/setup-vllm.sh
    break
  fi
  previous="$arg"
done
exec .venv/bin/layerwatch demo "$@"
