#!/usr/bin/env bash
# aiperf, one of the clients the tests run against a live `layerwatch serve` (tests/service/test_clients.py),
# in an environment of its own, .venv-aiperf: its pins would downgrade packages of .venv
# (prometheus-client, pandas, huggingface-hub; docs/service.md, "Clients"). The tests talk to it over
# HTTP only. Installs only when the pinned version changed; otherwise it prints nothing.
set -euo pipefail
cd "$(dirname "$0")/.."
python="${PYTHON:-python3}"
want="aiperf==0.13.0"
stamp=".venv-aiperf/.layerwatch-installed"

if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ]; then
  exit 0
fi
echo "setting up .venv-aiperf ($want)..."
rm -rf .venv-aiperf
"$python" -m venv .venv-aiperf
log="$(mktemp)"
if ! .venv-aiperf/bin/python -m pip install --quiet "$want" >"$log" 2>&1; then
  cat "$log" >&2
  echo "setup-aiperf: installing $want failed (log above)" >&2
  exit 1
fi
rm -f "$log"
echo "$want" > "$stamp"
