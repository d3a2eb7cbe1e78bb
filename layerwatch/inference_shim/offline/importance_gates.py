"""Gates fitted to per-token layer importance (`train-gates --method importance`; docs/gate-training.md).

The relaxed-decision recipe (gate_training.py) trains through the whole model at every step, which
a real pretrained model makes slow (SmolLM2-135M: ~57 training tokens/s on one CPU core). This one
asks the frozen backbone about each window once and then fits the tiny gates alone, as FlexiDepth-style
routers are distilled from importance targets:

1. **Score** (`score_windows`): per batch of windows, one full-depth pass keeping each layer's
   input, then for each skippable layer l the layers above it rerun from l's input: layer l skipped
   for the whole window, as a streak of skips does. The cost of (token t, layer l) is
   KL(full ‖ skipped) of the next-token distribution at t, in nats: the expected increase of the
   loss when the full model is right, without the noise of the one token that came. The layer's
   normed input (what its gate reads) is kept, in bfloat16. (A first-order estimate, −∂L/∂s of a
   scale s on the layer's update, costs a third as much but is useless here: on SmolLM2-135M it
   ranked layer 3 as the cheapest to skip, where skipping it costs 0.30 nats per token, and missed
   layer 11's 1.79.)
2. **Align with the skip rule**: decoding skips token t by the scores of the tokens before it, so
   the gate that reads token t is fitted to the cost of skipping token t + 1.
3. **Fit** (`fit_gates`): each skippable layer's gate logit regresses the standardised cost (Huber
   loss, AdamW, `fit_epochs` passes), so its score is monotone in the expected cost of a skip.
4. **Calibrate** (`calibrate_to_rate`): one affine map of every logit (the same for all layers, so
   a single τ still compares costs across layers), chosen so that under the skip rule at the
   threshold τ the training windows skip `target_skip` of their (token, skippable layer) pairs,
   with the pairs around that share spread from `low_score` up to τ. A lower τ at serve time
   skips less, a higher one more: the sweep of `layerwatch eval` is the trade-off curve.

Protected layers get a constant gate at the high score.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import cast

import torch
import torch.nn.functional as F

from layerwatch.inference_shim.offline.training import sample_windows
from layerwatch.inference_shim.runtime.model import Block, GateBank, Transformer


@dataclass
class ImportanceSample:
    """What the frozen backbone says about the scored windows (skippable layers only):
    inputs [L', W, T, d] bfloat16, each layer's normed input at tokens 0..T-2; costs [L', W, T] fp32,
    the cost of skipping the layer at the *next* token (KL, nats); layers: their indices."""

    inputs: torch.Tensor
    costs: torch.Tensor
    layers: tuple[int, ...]


@dataclass
class ImportanceStats:
    """Progress of one stage: 'score' (batch, batches) or 'fit' (epoch, epochs) with its mean loss."""

    stage: str
    done: int
    total: int
    loss: float


@torch.no_grad()
def score_windows(
    model: Transformer,
    stream: torch.Tensor,
    batches: int,
    batch_size: int,
    seq_len: int,
    skippable: tuple[int, ...],
    generator: torch.Generator,
    on_batch: Callable[[ImportanceStats], None] | None = None,
) -> ImportanceSample:
    """Score `batches` random batches of windows: a full-depth pass that keeps every layer's input,
    then for each skippable layer the layers above it rerun from its input (the layer skipped at
    every token of the window), and each token's KL(full ‖ skipped) is that layer's cost there."""
    model.eval()
    model.attach_gates(None)
    inputs: list[torch.Tensor] = []  # [L', B, T-1, d] per batch
    costs: list[torch.Tensor] = []
    layers = list(cast("Iterable[Block]", model.layers))  # nn.ModuleList is not generic
    for batch_index in range(batches):
        tokens = sample_windows(stream, batch_size, seq_len, generator)[:, :-1].to(next(model.parameters()).device)
        h = model.embed(tokens)
        cos, sin = model.rope(torch.arange(tokens.shape[1], device=tokens.device).expand_as(tokens), h.dtype)
        layer_inputs, normed = [], []
        for l, block in enumerate(layers):
            layer_inputs.append(h)
            x = block.input_layernorm(h)
            if l in skippable:
                normed.append(x[:, :-1].to(torch.bfloat16))
            h = block(h, x, cos, sin)[0]
        full = F.log_softmax(model.logits(h).float(), dim=-1)
        kls = []
        for l in skippable:
            h = layer_inputs[l]
            for block in layers[l + 1 :]:
                h = block(h, block.input_layernorm(h), cos, sin)[0]
            skipped = F.log_softmax(model.logits(h).float(), dim=-1)
            kl = (full.exp() * (full - skipped)).sum(-1)  # [B, T]
            kls.append(kl[:, 1:])  # the next token's cost, for the gate reading this one
        inputs.append(torch.stack(normed))
        costs.append(torch.stack(kls))
        if on_batch is not None:
            on_batch(ImportanceStats("score", batch_index + 1, batches, torch.stack(kls).mean().item()))
    return ImportanceSample(torch.cat(inputs, dim=1), torch.cat(costs, dim=1), skippable)


def fit_gates(
    gates: GateBank,
    sample: ImportanceSample,
    epochs: int,
    learning_rate: float,
    generator: torch.Generator,
    minibatch: int = 512,
    on_epoch: Callable[[ImportanceStats], None] | None = None,
) -> float:
    """Fit each skippable layer's gate logit to its standardised costs; returns the costs' standard
    deviation (the unit the logits were fitted in)."""
    spread = sample.costs.std().clamp_min(1e-12).item()
    with torch.no_grad():  # each gate starts at its layer's mean cost: the fit then learns the token's part
        for i, layer in enumerate(sample.layers):
            gates[layer].fc2.bias.fill_(sample.costs[i].mean().item() / spread)
    params = [p for l in sample.layers for p in gates[l].parameters()]
    optimizer = torch.optim.AdamW(params, lr=learning_rate, weight_decay=0.0)
    d = sample.inputs.shape[-1]
    flat_inputs = sample.inputs.reshape(len(sample.layers), -1, d)
    flat_targets = (sample.costs / spread).reshape(len(sample.layers), -1)
    count = flat_targets.shape[1]
    steps = max(1, math.ceil(count / minibatch))
    total_steps = epochs * steps
    for epoch in range(epochs):
        order = torch.randperm(count, generator=generator)
        total = 0.0
        for step in range(steps):
            done = epoch * steps + step
            for group in optimizer.param_groups:
                group["lr"] = learning_rate * 0.5 * (1 + math.cos(math.pi * done / total_steps))
            rows = order[step * minibatch : (step + 1) * minibatch]
            summed = sum(
                F.huber_loss(gates[layer].logit(flat_inputs[i, rows].float()), flat_targets[i, rows])
                for i, layer in enumerate(sample.layers)
            )
            loss = cast(torch.Tensor, summed) / len(sample.layers)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            total += loss.item()
        if on_epoch is not None:
            on_epoch(ImportanceStats("fit", epoch + 1, epochs, total / steps))
    return spread


@torch.no_grad()
def predicted_logits(gates: GateBank, sample: ImportanceSample) -> torch.Tensor:
    """[L', W, T] the gates' logits on the scored inputs."""
    return torch.stack([gates[l].logit(sample.inputs[i].float()) for i, l in enumerate(sample.layers)])


@torch.no_grad()
def calibrate_to_rate(
    gates: GateBank,
    sample: ImportanceSample,
    skip_fraction: Callable[[torch.Tensor], float],
    threshold: float,
    target_skip: float,
    low_score: float,
) -> None:
    """Rescale every skippable gate's logit ℓ to a·ℓ + b in place. a: the scored pairs' logits at
    the `target_skip` and `target_skip / 2` quantiles lie logit(threshold) − logit(low_score) apart,
    so the scores spread around τ where the decisions are made (a spread taken over all pairs is
    set by the expensive layers, and squeezed the cheap ones into a few hundredths of score around
    τ). b: found by bisection so that `skip_fraction(scores)` (the skip rule at `threshold`, applied
    to [L', W, T] scores) is `target_skip` on the scored windows."""
    logits = predicted_logits(gates, sample)
    ranked = logits.flatten().sort().values

    def at(share: float) -> float:
        return ranked[min(int(share * len(ranked)), len(ranked) - 1)].item()

    scale = (_logit(threshold) - _logit(low_score)) / max(at(target_skip) - at(target_skip / 2), 1e-12)
    low, high = -50.0, 50.0  # offsets: more skipping as the offset falls
    for _ in range(60):
        middle = (low + high) / 2
        if skip_fraction(torch.sigmoid(scale * logits + middle)) > target_skip:
            low = middle
        else:
            high = middle
    offset = (low + high) / 2
    for layer in sample.layers:
        fc2 = gates[layer].fc2
        fc2.weight.mul_(scale)
        fc2.bias.mul_(scale).add_(offset)


@torch.no_grad()
def hold_at(gates: GateBank, layers: tuple[int, ...], score: float) -> None:
    """A constant gate at `score` for each of `layers` (the protected ones)."""
    for layer in layers:
        gates[layer].fc2.weight.zero_()
        gates[layer].fc2.bias.fill_(_logit(score))


def _logit(p: float) -> float:
    return math.log(p / (1 - p))
