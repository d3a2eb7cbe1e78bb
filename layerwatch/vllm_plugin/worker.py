"""A vLLM worker extension (`--worker-extension-cls layerwatch.vllm_plugin.worker.LayerwatchWorker`): what
the gated model executed, readable through vLLM's `collective_rpc` (the LLM class's, or the server's
`/collective_rpc` in its development mode), one answer per worker."""

from __future__ import annotations

from typing import Any


class LayerwatchWorker:
    model_runner: Any  # the worker's, which vLLM mixes this class into

    def layerwatch_executed(self) -> dict[str, Any]:
        """Since start-up: `skips` per layer, the (step row, layer) pairs whose layer did not run; `step_rows`,
        the sequences' steps; `frames`, the gate frames sent (None on a rank that sends none)."""
        gating = self.model_runner.get_model().model.gating
        return {
            "skips": gating.executed_skips.tolist(),
            "step_rows": gating.step_rows,
            "frames": gating.sender.sent if gating.sender is not None else None,
        }
