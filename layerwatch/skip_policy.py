"""The skip policy's settings, torch-free: τ's default, its range, the comparison, the rule's knobs.

One home for what the model code (layerwatch/inference_shim/runtime/skip_policy.py decides the masks), the shim,
the gate files, the traces, the frames and the exporter all say about the policy: τ is a real number in
[0, 1] (`is_threshold`), its default is DEFAULT_THRESHOLD, a score counts toward skipping its layer when
it is strictly below τ (`below_threshold`), and a gate file's recorded policy plus the settings chosen
on top of it is `SkipPolicyConfig.recorded` (the one merge rule of the shim, eval and calibrate).
Each edge (the command line, a gate file, a trace line, a frame) checks τ once with these; the frozen
`SkipPolicyConfig` travels on from there.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

# τ when nothing says otherwise: the policy's default, and what a frame or trace line without one means.
DEFAULT_THRESHOLD = 0.18
SKIP_RULES = ("streak", "ewma")
# The skip policy settings a gate file records, named as in SkipPolicyConfig.
POLICY_FIELDS = ("threshold", "patience", "skip_rule", "ewma_alpha")
MAX_PATIENCE = 2**31 - 1  # the rule counts each sequence's steps in int32


def is_patience(value: object) -> bool:
    """Whether `value` is a patience: an integer (a bool is not one) in [1, MAX_PATIENCE]."""
    return _is_integer(value) and 1 <= value <= MAX_PATIENCE  # type: ignore[operator]


def is_threshold(value: object) -> bool:
    """Whether `value` is a τ: a real number (a bool is not one) in [0, 1] (NaN fails the comparison)."""
    return _is_real(value) and 0.0 <= value <= 1.0  # type: ignore[operator]


def _is_integer(value: object) -> bool:
    return isinstance(value, (int, np.integer)) and not isinstance(value, bool)


def _is_real(value: object) -> bool:
    return isinstance(value, (int, float, np.integer, np.floating)) and not isinstance(value, bool)


def check_threshold(threshold: float) -> float:
    if not is_threshold(threshold):
        raise ValueError(f"threshold must be in [0, 1], got {threshold}")
    return threshold


def below_threshold(entropies: np.ndarray, threshold: float | np.floating | np.ndarray) -> np.ndarray:
    """bool, the shape of `entropies`: the scores that count toward skipping, strictly below τ (as held
    by the caller: the runtime's float64 per row, the frame's float32). NaN (no gates) is never below."""
    return entropies < threshold


@dataclass(frozen=True)
class SkipPolicyConfig:
    threshold: float = DEFAULT_THRESHOLD  # tau: an entropy below this counts toward skipping the layer
    patience: int = 3  # k: consecutive decode steps below tau before the layer is skipped
    protected_layers: tuple[int, ...] | None = None  # never skipped; None = first and last layer
    fallback_skip_fraction: float = 0.85  # a step "skips too much" above this fraction of all layers
    fallback_trigger_steps: int = 3  # consecutive such steps that start a fallback episode
    fallback_steps: int = 16  # full-depth steps of one fallback episode
    skip_rule: str = SKIP_RULES[0]  # "streak" or "ewma" (layerwatch/inference_shim/runtime/skip_policy.py)
    # "ewma": the newest score's weight in (0, 1]; 0.5 averages over about as many steps as patience 3
    # (an EWMA's span N = 2 / alpha - 1). 1 = the last score alone. Unused by "streak".
    ewma_alpha: float = 0.5

    def __post_init__(self) -> None:
        check_threshold(self.threshold)
        if not _is_integer(self.patience):
            raise ValueError(f"patience must be an integer, got {self.patience!r}")
        if not is_patience(self.patience):
            raise ValueError(f"patience must be >= 1 and <= {MAX_PATIENCE}, got {self.patience}")
        if self.skip_rule not in SKIP_RULES:
            raise ValueError(f"skip rule must be one of {', '.join(SKIP_RULES)}, got {self.skip_rule!r}")
        if not _is_real(self.ewma_alpha) or not 0.0 < self.ewma_alpha <= 1.0:  # NaN fails too
            raise ValueError(f"ewma_alpha must be in (0, 1], got {self.ewma_alpha!r}")
        if not 0.0 <= self.fallback_skip_fraction <= 1.0:
            raise ValueError(f"fallback_skip_fraction must be in [0, 1], got {self.fallback_skip_fraction}")
        if self.fallback_trigger_steps < 1 or self.fallback_steps < 0:
            raise ValueError("fallback_trigger_steps must be >= 1 and fallback_steps >= 0")

    @classmethod
    def recorded(cls, recorded: Mapping[str, Any], **settings: Any) -> SkipPolicyConfig:
        """The policy a gate file records (its POLICY_FIELDS), with `settings` (SkipPolicyConfig fields)
        setting the others or overriding what it records; a setting of None keeps the file's."""
        chosen = {name: value for name, value in settings.items() if value is not None}
        return cls(**({name: recorded[name] for name in POLICY_FIELDS} | chosen))

    def rule_description(self) -> str:
        """The rule in words, for reports: "streak, patience 3" or "ewma alpha 0.5, warm-up 3"."""
        if self.skip_rule == "ewma":
            return f"ewma alpha {self.ewma_alpha:g}, warm-up {self.patience}"
        return f"streak, patience {self.patience}"

    def protected(self, num_layers: int) -> tuple[int, ...]:
        layers = (0, num_layers - 1) if self.protected_layers is None else self.protected_layers
        for l in layers:
            if not 0 <= l < num_layers:
                raise ValueError(f"protected layer {l} is outside 0..{num_layers - 1}")
        return tuple(sorted(set(layers)))

    def skippable(self, num_layers: int) -> np.ndarray:
        """bool [L]: the layers the rule may skip (all but the protected)."""
        mask = np.ones(num_layers, dtype=bool)
        mask[list(self.protected(num_layers))] = False
        return mask
