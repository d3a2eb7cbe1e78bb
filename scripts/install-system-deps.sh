#!/usr/bin/env bash
# Debian packages the tests use for real: Prometheus + promtool, Alertmanager + amtool,
# docker-compose (to validate the compose file; no engine needed) and the KJV text for the demo model.
set -euo pipefail
need=()
command -v prometheus >/dev/null || need+=(prometheus)
command -v promtool >/dev/null || need+=(prometheus)
command -v prometheus-alertmanager >/dev/null || need+=(prometheus-alertmanager)
command -v amtool >/dev/null || need+=(prometheus-alertmanager)
command -v docker-compose >/dev/null || need+=(docker-compose)
command -v bible >/dev/null || need+=(bible-kjv)
if [ ${#need[@]} -eq 0 ]; then
  exit 0
fi
sudo=""
[ "$(id -u)" -eq 0 ] || sudo="sudo"
export DEBIAN_FRONTEND=noninteractive
$sudo apt-get update -q
$sudo apt-get install -y -q --no-install-recommends $(printf '%s\n' "${need[@]}" | sort -u)
