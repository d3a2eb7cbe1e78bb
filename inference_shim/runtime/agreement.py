"""Full-depth agreement: how often the gated model's greedy tokens are the full-depth top-1.

A prompt + its generated tokens go through the model's full-depth forward in one teacher-forced
pass; at each generated position the full-depth top-1 token is compared with the token the gated
model produced. The service's quality guard (inference_shim/service/shadow.py) and `layerwatch
calibrate` both measure it this way.

The same pass can also measure every layer's signals on those positions (`layer_signals=True`, a
`LayerProbe` on the forward): how much the layer changed the residual stream, what its gate scored,
how discrete its attention was. The service uses them to check that the gates still track how much
their layer matters (inference_shim/service/layer_signals.py).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from inference_shim.runtime.model import LayerProbe, Transformer


@dataclass(frozen=True)
class ShadowJob:
    prompt_ids: list[int]
    generated_ids: list[int]


@dataclass(frozen=True)
class LayerSignals:
    """Per generated position (the decode steps' input tokens) and layer, fp32 [G, L] on the host."""

    relative_update: np.ndarray  # ||dh|| / ||h|| of the layer's residual update
    attention_kl: np.ndarray  # KL(attention || uniform), mean over heads, nats
    gate_score: np.ndarray | None  # the layer's gate on the full-depth normed input; None without gates


@dataclass(frozen=True)
class ShadowResult:
    tokens: int
    agreements: int
    layer_signals: LayerSignals | None = None  # only when asked for


def full_depth_agreement(model: Transformer, job: ShadowJob, layer_signals: bool = False) -> ShadowResult:
    """Teacher-forced full-depth top-1 over the generated tokens, compared with them.

    With `layer_signals`, also the layer signals of the positions whose logits are compared: the
    decode steps' inputs (the prompt's last token, then every generated token but the last).
    """
    device = model.embed_tokens.weight.device
    tokens = torch.tensor([job.prompt_ids + job.generated_ids], device=device)
    # The logits at position i predict token i + 1: the generated tokens are predicted from the
    # last prompt position onwards.
    first = len(job.prompt_ids) - 1
    generated = len(job.generated_ids)
    probe = LayerProbe(start=first) if layer_signals else None
    with torch.inference_mode():
        logits, _ = model(tokens, probe=probe)
    predicted = logits[0, first : first + generated].argmax(dim=-1)
    expected = torch.tensor(job.generated_ids, device=device)
    signals = None
    if probe is not None:
        if probe.relative_update is None or probe.attention_kl is None:
            raise RuntimeError("the full-depth forward did not fill the layer probe")

        def host(t: torch.Tensor) -> np.ndarray:
            return t[0, :generated].cpu().numpy()

        signals = LayerSignals(
            relative_update=host(probe.relative_update),
            attention_kl=host(probe.attention_kl),
            gate_score=host(probe.gate_score) if probe.gate_score is not None else None,
        )
    return ShadowResult(tokens=generated, agreements=int((predicted == expected).sum()), layer_signals=signals)
