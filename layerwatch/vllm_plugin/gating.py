"""What the gated model serves with inside vLLM, built and checked once at start-up, without vLLM.

The gate file is checked as `layerwatch serve` checks it (gates.load_gates_for: its shape and its base model's
fingerprint, read from the files of the checkpoint folder vLLM serves), the policy with the skip policy's own checks,
the frame destination and key with the frame sender's. The first bad one is a PluginSettingsError: one
line that names it and stops vLLM's start-up.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from layerwatch.client import GateFrameSender
from layerwatch.inference_shim.runtime.checkpoint import CONFIG_FILE, checkpoint_fingerprint, read_config
from layerwatch.inference_shim.runtime.gates import GateFileError, load_gates_for
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
    gates: GateBank  # on the model's device and dtype
    policy: SkipPolicy  # the one rule; its slots hold the sequences' states
    states: SequenceStates  # KV slot -> policy slot
    threshold: float  # τ of the sequences that start from now on (the policy's, unless set at run time)
    decides: bool  # this rank decides the masks (rank 0 of a tensor-parallel group) and sends the frames
    sender: GateFrameSender | None  # None: no exporter address, or not the deciding rank
    executed_skips: np.ndarray  # int64 [L]: (step row, layer) pairs whose layer did not run, since start-up
    step_rows: int = 0  # step rows run since start-up


def load_gating(
    settings: PluginSettings,
    folder: str,
    num_layers: int,
    served_name: str,
    dtype: torch.dtype,
    sequences: int,
    decides: bool,
) -> Gating:
    """The gates, policy and frame sender for the checkpoint `folder` of `num_layers` layers, served as
    `served_name` in `dtype`, with room for the states of `sequences` scheduled sequences; `decides`: this rank
    decides and sends. The cheap checks come first; the gates' fingerprint, which reads a few values of each
    weight from the checkpoint's files (never the weights whole: vLLM loads them), last."""
    if settings.protected_layers is not None:
        settings.policy(vars(SkipPolicyConfig()), num_layers)  # the protected layers inside the model
    sender = _frame_sender(settings, num_layers, served_name) if decides else None
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
        gates=loaded.gates,
        policy=SkipPolicy(policy, num_layers, slots=capacity),
        states=SequenceStates(capacity),
        threshold=policy.threshold,
        decides=decides,
        sender=sender,
        executed_skips=np.zeros(num_layers, dtype=np.int64),
    )


def _frame_sender(settings: PluginSettings, num_layers: int, served_name: str) -> GateFrameSender | None:
    """The sender to the exporter, or None without one; a key file given is checked either way."""
    try:
        key = load_frame_key(settings.frame_key_file) if settings.frame_key_file is not None else None
        if settings.exporter_address is None:
            return None
        return GateFrameSender(
            settings.exporter_address,
            settings.model_name or served_name,
            num_layers,
            settings.threshold if settings.threshold is not None else DEFAULT_THRESHOLD,
            key=key,
        )
    except (ValueError, TypeError, SecretFileError) as exc:
        raise PluginSettingsError(f"layerwatch: frames: {exc}") from None
