"""`vllm serve` with layerwatch's plugin, as the compose stack and the Kubernetes vLLM variant run it.

The plugin is chosen the way vLLM users choose an out-of-tree model: `--hf-overrides` names its
architecture and carries layerwatch's settings (layerwatch/vllm_plugin reads them). The model folder is
mounted at MODEL_DIR with its gates beside the weights, as `layerwatch import-gguf` and the shipped
gates lay it out.
"""

from __future__ import annotations

import json

from layerwatch import ports
from layerwatch.mixin import config

ARCHITECTURE = "LayerwatchLlamaForCausalLM"
MODEL_DIR = "/models/served"
GATES = f"{MODEL_DIR}/gates.safetensors"


def hf_overrides(exporter_address: str, model_name: str = config.VLLM_SERVED_MODEL_NAME) -> dict:
    """The plugin's settings: its gates, where its gate frames go, and the model name they carry
    (the served name, so that vLLM's series and the exporter's agree on model_name)."""
    return {
        "architectures": [ARCHITECTURE],
        "layerwatch": {"gates": GATES, "exporter_address": exporter_address, "model_name": model_name},
    }


def serve_args(exporter_address: str, model_name: str = config.VLLM_SERVED_MODEL_NAME) -> list[str]:
    """The arguments after `vllm serve`."""
    overrides = json.dumps(hf_overrides(exporter_address, model_name), separators=(", ", ": "))
    return [
        MODEL_DIR,
        "--served-model-name",
        model_name,
        "--host",
        "0.0.0.0",
        "--port",
        str(ports.VLLM_HTTP_PORT),
        "--scheduling-policy",  # the quality guard's full-depth re-checks ask for a low priority
        "priority",
        "--hf-overrides",
        overrides,
    ]
