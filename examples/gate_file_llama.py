"""layerwatch's own gate file on a transformers Llama: the serving engine's skip decisions, in `generate()`.

    .venv/bin/python -m examples.gate_file_llama [--model DIR] [--gates FILE] [--exporter 127.0.0.1:9410]

A checkpoint folder that `layerwatch serve` serves (the demo model by default) is loaded by
transformers; each decoder layer gets its gate from the gate file (layerwatch/inference_shim/runtime/gates.py,
refused unless it was trained on this checkpoint), and the skip policy the gate file records decides,
before every forward, which rows run which layer, from the earlier steps' scores: the same rule,
protected layers and fallback breaker as the engine (layerwatch/inference_shim/runtime/skip_policy.py). A
skipped (token, layer) keeps its hidden state and still writes its keys and values from the layer's
normed input: the engine's `project` KV policy. So the skip decisions are the engine's, row for row
(tests/instrument/test_transformers.py checks that against the GenerationEngine on one checkpoint);
`layerwatch.integrations.transformers` publishes them, reading `gate_score` and `gate_ran`.

What transformers does not give: whole-layer savings (every row runs every layer and the skipped
rows' updates are dropped), the `evict` KV policy, batch consensus and per-request thresholds.
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
import transformers
from torch import nn

from layerwatch.client import GateFrameSender
from layerwatch.inference_shim.runtime.checkpoint import load_checkpoint
from layerwatch.inference_shim.runtime.demo_model import DEMO_MODEL_DIR, DEMO_MODEL_NAME
from layerwatch.inference_shim.runtime.gates import LoadedGates, gates_path_for, load_gates
from layerwatch.inference_shim.runtime.model import Gate, GateBank
from layerwatch.inference_shim.runtime.skip_policy import SkipPolicy
from layerwatch.inference_shim.runtime.tokenizer import Tokenizer
from layerwatch.integrations.transformers import observe, read_attributes
from layerwatch.skip_policy import SkipPolicyConfig
from layerwatch.trace import TraceWriter
from layerwatch.wire import DEFAULT_FRAMES_ADDRESS

PROMPTS = (
    "In the beginning",
    "And the earth was",
    "Blessed are the",
    "The LORD is my",
    "And it came to pass",
    "Let there be",
    "For God so loved",
    "In my Father's house",
)


class GatedDecoderLayer(nn.Module):
    """A decoder layer with its layerwatch gate: the gate scores the layer's normed input
    (`gate_score`, [batch, tokens]); rows the plan skips keep their hidden state (`gate_ran`)."""

    def __init__(self, layer: Any, gate: Gate, index: int, plan: SkipPlan) -> None:
        super().__init__()
        self.layer = layer
        self.gate = gate
        self.index = index
        self.plan = plan
        self.gate_score: torch.Tensor | None = None
        self.gate_ran: torch.Tensor | None = None  # bool [batch, 1]; None: every row ran (full depth)

    def forward(self, hidden_states: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        self.gate_score = self.gate(self.layer.input_layernorm(hidden_states))
        output = self.layer(hidden_states, *args, **kwargs)
        runs = self.plan.runs(self.index)
        self.gate_ran = None if runs is None else runs[:, None]
        if runs is None:
            return output
        updated = output[0] if isinstance(output, tuple) else output  # transformers 4 returned a tuple
        kept = torch.where(runs[:, None, None], updated, hidden_states)
        return (kept, *output[1:]) if isinstance(output, tuple) else kept


class SkipPlan:
    """The engine's skip policy over the rows of a `generate()`: each forward's run mask comes from the
    earlier forwards' gate scores (host side, known before the forward starts), and after the forward
    its scores are fed back with one device-to-host transfer, as the engine does per decode step.

    A forward on an empty KV cache (the prefill) starts a new policy, one slot per row: the prefill
    runs at full depth and its last position is the sequence's first decode step."""

    def __init__(self, model: nn.Module, layers: list[GatedDecoderLayer], policy: SkipPolicyConfig) -> None:
        self.config = policy
        self.layers = layers
        self.policy: SkipPolicy | None = None
        self._slots = np.zeros(0, dtype=np.int64)
        self._mask = np.ones((0, len(layers)), dtype=bool)
        self._runs: torch.Tensor | None = None  # bool [batch, layers] on the device; None: all run
        model.register_forward_pre_hook(self._before, with_kwargs=True)
        model.register_forward_hook(self._after)

    def runs(self, layer: int) -> torch.Tensor | None:
        """bool [batch] for this forward: which rows run `layer`; None when every row runs it."""
        return None if self._runs is None else self._runs[:, layer]

    def _before(self, module: nn.Module, args: tuple, kwargs: dict[str, Any]) -> None:
        fed = kwargs.get("input_ids", args[0] if args else None)
        fed = fed if isinstance(fed, torch.Tensor) else kwargs["inputs_embeds"]
        rows = fed.shape[0]
        if self.policy is None or _cached_tokens(kwargs) == 0:
            self.policy = SkipPolicy(self.config, len(self.layers), rows)
        self._slots = np.arange(rows)
        self._mask = self.policy.run_mask(self._slots)
        self._runs = None if self._mask.all() else torch.as_tensor(self._mask, device=fed.device)

    def _after(self, module: nn.Module, args: tuple, output: Any) -> None:
        assert self.policy is not None
        newest = [layer.gate_score[:, -1] for layer in self.layers if layer.gate_score is not None]
        scores = torch.stack(newest, dim=1).float().cpu().numpy()
        self.policy.observe(self._slots, scores, self._mask)


def _cached_tokens(kwargs: dict[str, Any]) -> int:
    cache = kwargs.get("cache", kwargs.get("past_key_values"))  # transformers 5 renamed it `cache`
    return 0 if cache is None else int(cache.get_seq_length())


def attach_gates(model: transformers.PreTrainedModel, gates: GateBank, policy: SkipPolicyConfig) -> SkipPlan:
    """Wrap `model`'s decoder layers with `gates` (moved to the model's device and dtype) under `policy`."""
    layers = model.get_decoder().layers
    weight = next(model.parameters())
    gates = gates.to(device=weight.device, dtype=weight.dtype).eval()
    wrapped: list[GatedDecoderLayer] = []
    plan = SkipPlan(model, wrapped, policy)
    for index, layer in enumerate(layers):
        wrapped.append(GatedDecoderLayer(layer, gates[index], index, plan))
        layers[index] = wrapped[-1]
    return plan


@dataclass
class GatedTransformers:
    model: Any  # a transformers causal LM (PreTrainedModel and GenerationMixin) with GatedDecoderLayers
    plan: SkipPlan
    gates: LoadedGates
    tokenizer: Tokenizer


def load_gated_llama(folder: str | Path, gates_path: str | Path | None = None, **policy: Any) -> GatedTransformers:
    """The checkpoint folder in transformers with its gate file attached. The gate file is checked
    against the checkpoint by layerwatch's own loader (fingerprint, shapes); `policy` overrides the
    skip policy settings the file records (SkipPolicyConfig fields, e.g. threshold=0.2)."""
    checkpoint = load_checkpoint(folder)
    loaded = load_gates(gates_path_for(folder, gates_path), checkpoint.model)
    model = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    plan = attach_gates(model, loaded.gates, loaded.metadata.policy(**policy))
    return GatedTransformers(model, plan, loaded, checkpoint.tokenizer)


def left_padded(prompts: list[list[int]], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Token ids and attention mask of the prompts, left-padded as decoder-only generation needs."""
    width = max(map(len, prompts))
    ids = torch.tensor([[pad_id] * (width - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    return ids, mask


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", type=Path, default=DEMO_MODEL_DIR, help="checkpoint folder (default: the demo)")
    parser.add_argument("--gates", type=Path, help="gate file (default: gates.safetensors in the folder)")
    parser.add_argument("--model-name", default=f"{DEMO_MODEL_NAME}-transformers")
    parser.add_argument("--exporter", default=DEFAULT_FRAMES_ADDRESS, help="the exporter's --listen address")
    parser.add_argument("--trace", help="also write a trace file (for layerwatch replay and calibrate-trace)")
    parser.add_argument("--max-new-tokens", type=int, default=32)
    parser.add_argument("--temperature", type=float, default=0.8)
    args = parser.parse_args(argv)

    gated = load_gated_llama(args.model, args.gates)
    threshold = gated.plan.config.threshold
    layers = gated.model.config.num_hidden_layers
    sender = GateFrameSender(args.exporter, args.model_name, layers, threshold)
    trace = TraceWriter(args.trace, 100 << 20, threshold=threshold) if args.trace else None
    eos = gated.model.config.eos_token_id
    ids, mask = left_padded([gated.tokenizer.encode(text) for text in PROMPTS], pad_id=eos)
    with sender, observe(gated.model, read_attributes("gate_score", "gate_ran"), sender=sender, trace=trace) as watch:
        output = gated.model.generate(
            ids,
            attention_mask=mask,
            max_new_tokens=args.max_new_tokens,
            do_sample=True,
            temperature=args.temperature,
            pad_token_id=eos,
        )
    for row in output[:, ids.shape[1] :].tolist()[:3]:
        print(repr(gated.tokenizer.decode([t for t in row if t != eos])))
    print(f"{watch.rows} tokens in {watch.steps} steps: {sender.sent} frames sent, dropped {sender.dropped}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
