#!/usr/bin/env bash
# Debian packages the tests use for real: Prometheus + promtool, Alertmanager + amtool,
# VictoriaMetrics (the long-term store Prometheus remote-writes to in the fleet test), docker-compose
# (to validate the compose file; no engine needed) and the KJV text for the demo model.
# With --demo, only what `layerwatch demo` runs: Prometheus and Alertmanager.
# Needs root or sudo when something is missing.
set -euo pipefail
need=()
command -v prometheus >/dev/null || need+=(prometheus)
command -v prometheus-alertmanager >/dev/null || need+=(prometheus-alertmanager)
if [ "${1:-}" != "--demo" ]; then
  command -v promtool >/dev/null || need+=(prometheus)
  command -v amtool >/dev/null || need+=(prometheus-alertmanager)
  command -v victoria-metrics >/dev/null || need+=(victoria-metrics)
  command -v docker-compose >/dev/null || need+=(docker-compose)
  command -v bible >/dev/null || need+=(bible-kjv)
fi
if [ ${#need[@]} -eq 0 ]; then
  exit 0
fi
sudo=""
[ "$(id -u)" -eq 0 ] || sudo="sudo"
export DEBIAN_FRONTEND=noninteractive
packages="$(printf '%s\n' "${need[@]}" | sort -u | tr '\n' ' ')"
echo "installing Debian packages: $packages"
# apt's progress goes to a log that is shown only when the install fails.
log="$(mktemp)"
if ! { $sudo apt-get update -q && $sudo apt-get install -y -q --no-install-recommends $packages; } >"$log" 2>&1; then
  cat "$log" >&2
  echo "install-system-deps: installing $packages failed (log above)" >&2
  exit 1
fi
rm -f "$log"
