"""The plugin's settings: the `layerwatch` object of `--hf-overrides`, read and checked once at start-up.

vLLM hands the object over as `hf_config.layerwatch` (a dict). Every key is a PluginSettings field; an
unknown key, a τ out of range, a gate file that is missing or belongs to another model stops start-up
with one line (`PluginSettingsError`) that names the setting. The checks are the project's own: the
skip policy's (SkipPolicyConfig), the gate file's (gates.load_gates against the checkpoint's fingerprint),
the frame sender's (GateFrameSender) and the frame key file's (load_frame_key).
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from layerwatch.skip_policy import SkipPolicyConfig

# The policy knobs a gate file records; a setting of None keeps the file's (SkipPolicyConfig.recorded).
POLICY_SETTINGS = ("threshold", "patience", "skip_rule", "ewma_alpha", "protected_layers")


class PluginSettingsError(ValueError):
    """A bad setting: one line, naming it, that stops vLLM's start-up."""


@dataclass(frozen=True)
class PluginSettings:
    gates: str | None = None  # the gate file; None: gates.safetensors in the model folder
    threshold: float | None = None  # τ in [0, 1]; None: the gate file's; 0 serves at full depth
    patience: int | None = None  # decode steps below τ before a layer is skipped; None: the file's
    skip_rule: str | None = None  # "streak" or "ewma"; None: the file's
    ewma_alpha: float | None = None  # the "ewma" rule's weight of the newest score; None: the file's
    protected_layers: tuple[int, ...] | None = None  # never skipped; None: the first and the last layer
    exporter_address: str | None = None  # HOST:PORT of the exporter's --listen; None: no frames are sent
    model_name: str | None = None  # the frames' model name; None: the name vLLM serves the model under
    frame_key_file: str | None = None  # the frame key (layerwatch.wire.load_frame_key); None: untagged frames

    @classmethod
    def from_overrides(cls, raw: object) -> PluginSettings:
        """The settings from `hf_config.layerwatch`; PluginSettingsError names an unknown key or a value of the
        wrong type."""
        if raw is None:
            return cls()
        if not isinstance(raw, Mapping):
            raise PluginSettingsError(f"layerwatch: the `layerwatch` override must be an object, got {raw!r}")
        known = {field.name for field in dataclasses.fields(cls)}
        unknown = sorted(set(raw) - known)
        if unknown:
            raise PluginSettingsError(f"layerwatch: unknown setting {unknown[0]!r} (known: {', '.join(sorted(known))})")
        values = dict(raw)
        if values.get("protected_layers") is not None:
            layers = values["protected_layers"]
            if not isinstance(layers, list | tuple) or not all(_is_int(layer) for layer in layers):
                raise PluginSettingsError(
                    f"layerwatch: protected_layers must be a list of layer numbers, got {layers!r}"
                )
            values["protected_layers"] = tuple(layers)
        for name in ("gates", "skip_rule", "exporter_address", "model_name", "frame_key_file"):
            if values.get(name) is not None and not (isinstance(values[name], str) and values[name]):
                raise PluginSettingsError(
                    f"layerwatch: {name} must be a non-empty string, got {json.dumps(values[name])}"
                )
        settings = cls(**values)
        given = {name: getattr(settings, name) for name in POLICY_SETTINGS if getattr(settings, name) is not None}
        try:  # the policy's own checks of what is given, before any file is read
            SkipPolicyConfig(**given)
        except ValueError as exc:
            raise PluginSettingsError(f"layerwatch: {exc}") from None
        return settings

    def gate_path(self, model_dir: str | Path) -> Path:
        return Path(self.gates) if self.gates is not None else Path(model_dir) / "gates.safetensors"

    def policy(self, recorded: Mapping[str, Any], num_layers: int) -> SkipPolicyConfig:
        """The skip policy: what the gate file records, the settings given on top; the protected layers checked
        against the model's."""
        chosen = {name: getattr(self, name) for name in POLICY_SETTINGS}
        try:
            config = SkipPolicyConfig.recorded(recorded, **chosen)
            config.protected(num_layers)
        except ValueError as exc:
            raise PluginSettingsError(f"layerwatch: {exc}") from None
        return config


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)
