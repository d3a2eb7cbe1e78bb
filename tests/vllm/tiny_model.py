"""A small random Llama with random gates, saved as a checkpoint folder with SmolLM2's tokenizer: a model vLLM
can split over two tensor-parallel ranks (SmolLM2's 9 attention heads cannot be), and another model's gates for
the settings' checks. Its gates' output layer is scaled up so that their scores spread over (0, 1) and the rule's
decisions depend on the tokens."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import torch

from layerwatch.inference_shim.runtime.checkpoint import load_checkpoint, save_checkpoint
from layerwatch.inference_shim.runtime.gates import GATES_FILE, load_gates, reset_gates, save_gates
from layerwatch.inference_shim.runtime.model import ModelConfig, Transformer
from tests.conftest import RealModel

GATE_SPREAD = 8.0  # the gates' last layer times this: scores of random gates otherwise sit near 0.5


def tiny_config(vocab_size: int) -> ModelConfig:
    # 4 query and 2 key/value heads of width 64 (a head size vLLM's CPU attention takes): 2 ranks split them.
    return ModelConfig(
        vocab_size=vocab_size,
        hidden_size=256,
        intermediate_size=512,
        num_layers=6,
        num_heads=4,
        num_kv_heads=2,
        head_dim=64,
        max_position_embeddings=1024,
        tie_word_embeddings=True,
        bos_token_id=1,
        eos_token_ids=(2,),
    )


def save_tiny_model(real_model: RealModel, folder: Path, seed: int = 0) -> Path:
    """The folder, with its gates as gates.safetensors."""
    vocab_size = json.loads((real_model.folder / "config.json").read_text())["vocab_size"]
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = Transformer(tiny_config(vocab_size)).eval()
    save_checkpoint(model, real_model.folder / "tokenizer.json", folder)
    loaded = reset_gates(load_checkpoint(folder).model, seed)
    with torch.no_grad():
        for gate in loaded.gates.gates:
            gate.fc2.weight.mul_(GATE_SPREAD)
    save_gates(folder / GATES_FILE, loaded.gates, loaded.metadata)
    return folder


def median_threshold(folder: Path, seed: int = 0) -> float:
    """A τ that half of the unprotected layers' gate scores fall below, over random tokens."""
    checkpoint = load_checkpoint(folder)
    checkpoint.model.attach_gates(load_gates(folder / GATES_FILE, checkpoint.model).gates)
    tokens = torch.randint(0, checkpoint.config.vocab_size, (4, 32), generator=torch.Generator().manual_seed(seed))
    with torch.no_grad():
        _, scores = checkpoint.model(tokens)  # [B, T, L]
    return float(np.median(scores[..., 1:-1].numpy()))
