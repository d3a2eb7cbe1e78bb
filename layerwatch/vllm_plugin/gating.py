"""What the gated model serves with inside vLLM, built and checked once at start-up, without vLLM.

The gate file is checked as `layerwatch serve` checks it (gates.load_gates_for: its shape and its base model's
fingerprint, read from the files of the checkpoint folder vLLM serves), the policy with the skip policy's own checks,
the frame destination and key with the frame sender's. The first bad one is a PluginSettingsError: one
line that names it and stops vLLM's start-up.

Under pipeline parallelism a stage runs a contiguous run of the model's layers (`layers`): it keeps the
gates, the policy state and the counters of those alone, and its frames are partial (wire version 3), so
that the exporter files each score under its model layer.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import numpy as np
import torch

from layerwatch.client import GateFrameSender
from layerwatch.inference_shim.runtime.checkpoint import CONFIG_FILE, checkpoint_fingerprint, read_config
from layerwatch.inference_shim.runtime.gates import GateFileError, LoadedGates, load_gates_for
from layerwatch.inference_shim.runtime.model import GateBank
from layerwatch.inference_shim.runtime.skip_policy import SkipPolicy
from layerwatch.secret_file import SecretFileError
from layerwatch.skip_policy import DEFAULT_THRESHOLD, SkipPolicyConfig
from layerwatch.vllm_plugin.sequences import SequenceStates
from layerwatch.vllm_plugin.settings import PluginSettings, PluginSettingsError
from layerwatch.wire import load_frame_key

STATES_PER_SEQUENCE = 4  # policy states kept per sequence vLLM may schedule: room for finished ones


@dataclass
class Gating:
    layers: range  # the model layers this stage runs (all of them without pipeline parallelism)
    gates: GateBank  # of those layers, on the model's device and dtype
    policy: SkipPolicy  # the one rule over those layers; its slots hold the sequences' states
    states: SequenceStates  # KV slot -> policy slot
    threshold: float  # τ of the sequences that start from now on (the policy's, unless set at run time)
    decides: bool  # this rank decides the masks (rank 0 of a tensor-parallel group) and sends the frames
    sender: GateFrameSender | None  # None: no exporter address, or not the deciding rank
    executed_skips: np.ndarray  # int64 [layers]: (step row, layer) pairs whose layer did not run, since start-up
    step_rows: int = 0  # step rows run since start-up
    fallbacks: int = 0  # fallback episodes the policy started since start-up (deciding rank)


def load_gating(
    settings: PluginSettings,
    folder: str,
    num_layers: int,
    served_name: str,
    dtype: torch.dtype,
    sequences: int,
    decides: bool,
    layers: range | None = None,
) -> Gating:
    """The gates, policy and frame sender for `layers` (None: all) of the checkpoint `folder` of `num_layers`
    layers, served as `served_name` in `dtype`, with room for the states of `sequences` scheduled sequences;
    `decides`: this rank decides and sends. The cheap checks come first; the gates' fingerprint, which reads a
    few values of each weight from the checkpoint's files (never the weights whole: vLLM loads them), last."""
    layers = range(num_layers) if layers is None else layers
    if settings.protected_layers is not None:
        settings.policy(vars(SkipPolicyConfig()), num_layers)  # the protected layers inside the model
    sender = _frame_sender(settings, layers, num_layers, served_name) if decides else None
    try:
        # The gates are checked against the fingerprint of the checkpoint as the shim loads it, in vLLM's dtype,
        # and placed in that dtype (rounded to another first, every score would move).
        config = read_config(folder)
        if config.num_layers != num_layers:
            raise ValueError(f"{folder}: {config.num_layers} layers in {CONFIG_FILE}, vLLM serves {num_layers}")
        loaded = load_gates_for(
            settings.gate_path(folder),
            config,
            lambda: checkpoint_fingerprint(folder, dtype),
            torch.device("cpu"),
            dtype,
        )
    except (GateFileError, ValueError) as exc:  # CheckpointError is a ValueError
        raise PluginSettingsError(f"layerwatch: gates: {str(exc).splitlines()[0]}") from None
    policy = settings.policy(vars(loaded.metadata), num_layers)
    if sender is not None:
        sender.threshold = policy.threshold  # the gate file's, where the settings name none
    capacity = STATES_PER_SEQUENCE * sequences
    return Gating(
        layers=layers,
        gates=_stage_gates(loaded, layers),
        policy=SkipPolicy(_stage_policy(policy, layers, num_layers), len(layers), slots=capacity),
        states=SequenceStates(capacity),
        threshold=policy.threshold,
        decides=decides,
        sender=sender,
        executed_skips=np.zeros(len(layers), dtype=np.int64),
    )


def _stage_gates(loaded: LoadedGates, layers: range) -> GateBank:
    """The gates of `layers`, as the loaded bank placed them."""
    if len(layers) == len(loaded.gates):
        return loaded.gates
    reference = next(loaded.gates.parameters())
    stage = GateBank(len(layers), loaded.metadata.hidden_size).to(device=reference.device, dtype=reference.dtype)
    with torch.no_grad():
        for gate, layer in zip(stage.gates, layers):
            gate.load_state_dict(loaded.gates[layer].state_dict())
    return stage.eval()


def _stage_policy(policy: SkipPolicyConfig, layers: range, num_layers: int) -> SkipPolicyConfig:
    """The policy over `layers` alone: the model's protected layers among them, renumbered from the stage's
    first. The fallback breaker then counts the stage's layers (docs/vllm.md, "Past one machine")."""
    if len(layers) == num_layers:
        return policy
    protected = tuple(layer - layers.start for layer in policy.protected(num_layers) if layer in layers)
    return replace(policy, protected_layers=protected)


def _frame_sender(settings: PluginSettings, layers: range, num_layers: int, served_name: str) -> GateFrameSender | None:
    """The sender to the exporter, or None without one; a key file given is checked either way."""
    try:
        key = load_frame_key(settings.frame_key_file) if settings.frame_key_file is not None else None
        if settings.exporter_address is None:
            return None
        return GateFrameSender(
            settings.exporter_address,
            settings.model_name or served_name,
            len(layers),
            settings.threshold if settings.threshold is not None else DEFAULT_THRESHOLD,
            key=key,
            first_layer=layers.start,
            model_layers=num_layers,
        )
    except (ValueError, TypeError, SecretFileError) as exc:
        raise PluginSettingsError(f"layerwatch: frames: {exc}") from None
