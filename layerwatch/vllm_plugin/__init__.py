"""layerwatch's vLLM plugin: per-token layer skipping inside vLLM's batches (docs/vllm.md).

vLLM loads `register` through the `vllm.general_plugins` entry point in every process it starts; it
names the gated model to vLLM's registry without importing it (the model module imports torch and vLLM,
loaded where the model is built). `vllm serve DIR --hf-overrides '{"architectures":
["LayerwatchLlamaForCausalLM"], "layerwatch": {...}}'` then selects it.
"""

from __future__ import annotations

ARCHITECTURE = "LayerwatchLlamaForCausalLM"


def register() -> None:
    from vllm import ModelRegistry

    if ARCHITECTURE not in ModelRegistry.get_supported_archs():
        ModelRegistry.register_model(ARCHITECTURE, f"layerwatch.vllm_plugin.model:{ARCHITECTURE}")
