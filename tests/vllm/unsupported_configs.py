"""Run in .venv-vllm by the tests (tests/vllm_engine.run_helper): the plugin's start-up refusal of each vLLM feature
its decoder loop cannot serve, on the VllmConfig vLLM's own argument handling makes for FOLDER with that feature
asked for (no engine is started); the line of stdout after RESULT is JSON, feature -> the refusal, or null.

    unsupported_configs.py FOLDER
"""

from __future__ import annotations

import json
import sys

from vllm.engine.arg_utils import EngineArgs

from layerwatch.vllm_plugin.model import refuse_unsupported
from layerwatch.vllm_plugin.settings import PluginSettingsError

RESULT = "RESULT "
FEATURES = {
    "none": {},
    "pipeline parallelism, eager": {"pipeline_parallel_size": 2},
    "pipeline parallelism, compiled": {"pipeline_parallel_size": 2, "enforce_eager": False},
    "speculative decoding": {
        "speculative_config": {"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_max": 3}
    },
    "LoRA": {"enable_lora": True},
}


def refusal(folder: str, feature: dict) -> str | None:
    settings = {"model": folder, "dtype": "float32", "enforce_eager": True, "max_model_len": 512} | feature
    config = EngineArgs(**settings)
    try:
        refuse_unsupported(config.create_engine_config())
    except PluginSettingsError as exc:
        return str(exc)
    return None


if __name__ == "__main__":
    print(RESULT + json.dumps({name: refusal(sys.argv[1], feature) for name, feature in FEATURES.items()}), flush=True)
