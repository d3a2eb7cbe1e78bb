"""Tiny real models and tokenizers for the model tests (random weights, a few thousand parameters)."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import pytest
import torch
from tokenizers import Tokenizer as BackendTokenizer
from tokenizers import decoders, models, pre_tokenizers, trainers

from layerwatch.inference_shim.runtime.model import GateBank, ModelConfig, Transformer
from layerwatch.inference_shim.runtime.tokenizer import Tokenizer

TRAINING_TEXT = [
    "In the beginning God created the heaven and the earth.",
    "And the earth was without form, and void; and darkness was upon the face of the deep.",
    "And God said, Let there be light: and there was light. Ünïcödé: naïve café, 日本語, ✓",
]
VOCAB_SIZE = 300  # 256 byte symbols, 2 special tokens, a few merges


@pytest.fixture(autouse=True)
def _one_thread():
    torch.set_num_threads(1)


def build_backend_tokenizer(texts: Sequence[str] = TRAINING_TEXT) -> BackendTokenizer:
    """Byte-level BPE trained on `texts`: every string encodes, and multi-byte characters span several
    tokens."""
    backend = BackendTokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        special_tokens=["<s>", "</s>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    backend.train_from_iterator(list(texts) * 4, trainer)
    return backend


@pytest.fixture(scope="session")
def backend_tokenizer() -> BackendTokenizer:
    return build_backend_tokenizer()


@pytest.fixture(scope="session")
def tokenizer(backend_tokenizer) -> Tokenizer:
    return Tokenizer(backend_tokenizer, bos_token="<s>", eos_tokens=["</s>"], add_bos_token=True)


def tiny_config(**overrides) -> ModelConfig:
    values = dict(
        vocab_size=VOCAB_SIZE,
        hidden_size=32,
        intermediate_size=64,
        num_layers=4,
        num_heads=4,
        num_kv_heads=2,
        head_dim=8,
        max_position_embeddings=512,
        bos_token_id=0,
        eos_token_ids=(1,),
    )
    values.update(overrides)
    return ModelConfig(**values)


def random_model(config: ModelConfig | None = None, seed: int = 0, std: float = 0.3) -> Transformer:
    """A random model whose every weight (norms included) matters, so that mistakes show in logits."""
    config = config or tiny_config()
    torch.manual_seed(seed)
    model = Transformer(config)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1 + 0.2 * torch.randn_like(p))
            else:
                p.normal_(0.0, std)
    return model.eval()


def random_gates(config: ModelConfig, seed: int = 1) -> GateBank:
    torch.manual_seed(seed)
    return GateBank(config.num_layers, config.hidden_size).eval()


def constant_gates(config: ModelConfig, entropy_logit: float) -> GateBank:
    """Gates whose output is sigmoid(entropy_logit) for every token (e.g. -30: entropy ~ 0)."""
    gates = GateBank(config.num_layers, config.hidden_size)
    with torch.no_grad():
        for gate in gates.gates:
            gate.fc2.weight.zero_()
            gate.fc2.bias.fill_(entropy_logit)
    return gates.eval()


@pytest.fixture
def tokenizer_json(tmp_path, backend_tokenizer) -> Path:
    path = tmp_path / "source-tokenizer.json"
    backend_tokenizer.save(str(path))
    return path
