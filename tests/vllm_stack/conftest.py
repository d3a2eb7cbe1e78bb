"""The session's one vLLM engine (tests/vllm_engine.py: `vllm serve` with layerwatch's plugin on the real SmolLM2
folder, served under the name the deploy files serve, config.VLLM_SERVED_MODEL_NAME, so that the rules use that
model's profile): the base URL of its OpenAI-compatible API and /metrics for the stack's tests, whose exporter
listens where the plugin sends its gate frames."""

from __future__ import annotations

import pytest

from tests.vllm_engine import REPO, SERVED_MODEL_NAME, VllmEngine

__all__ = ["REPO", "SERVED_MODEL_NAME"]


@pytest.fixture(scope="session")
def vllm_base_url(vllm_engine: VllmEngine) -> str:
    return vllm_engine.base_url
