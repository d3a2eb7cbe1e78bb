"""A vLLM worker extension (`--worker-extension-cls layerwatch.vllm_plugin.worker.LayerwatchWorker`): what
the gated model executed, and τ changed at run time, through vLLM's `collective_rpc` (the LLM class's, or
the server's `/collective_rpc` in its development mode, whose arguments are strings), one answer per worker."""

from __future__ import annotations

from typing import Any

from layerwatch.skip_policy import check_threshold


class LayerwatchWorker:
    model_runner: Any  # the worker's, which vLLM mixes this class into

    def layerwatch_executed(self) -> dict[str, Any]:
        """Since start-up: `skips` per layer of the worker's stage (its first model layer `first_layer`), the
        (step row, layer) pairs whose layer did not run; `step_rows`, the sequences' steps; `fallbacks`, the
        fallback episodes its breaker started (0 on a rank that does not decide); `frames`, the gate frames sent
        (None on a rank that sends none)."""
        gating = self._gating()
        return {
            "first_layer": gating.layers.start,
            "skips": gating.executed_skips.tolist(),
            "step_rows": gating.step_rows,
            "fallbacks": gating.fallbacks,
            "frames": gating.sender.sent if gating.sender is not None else None,
        }

    def layerwatch_set_threshold(self, threshold: str | float) -> float:
        """τ for the sequences that start from now on (0: full depth); those already running keep theirs.
        The frames carry it from the next one. A τ outside [0, 1] raises ValueError and changes nothing."""
        tau = check_threshold(float(threshold))
        gating = self._gating()
        gating.threshold = tau
        if gating.sender is not None:
            gating.sender.threshold = tau
        return tau

    def _gating(self) -> Any:
        return self.model_runner.get_model().model.gating
