"""Full-depth agreement: how often the gated model's greedy tokens are the full-depth top-1.

A prompt + its generated tokens go through the model's full-depth forward in one teacher-forced
pass; at each generated position the full-depth top-1 token is compared with the token the gated
model produced. The service's quality guard (inference_shim/service/shadow.py) and `layerwatch
calibrate` both measure it this way.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from inference_shim.runtime.model import Transformer


@dataclass(frozen=True)
class ShadowJob:
    prompt_ids: list[int]
    generated_ids: list[int]


@dataclass(frozen=True)
class ShadowResult:
    tokens: int
    agreements: int


def full_depth_agreement(model: Transformer, job: ShadowJob) -> ShadowResult:
    """Teacher-forced full-depth top-1 over the generated tokens, compared with them."""
    device = model.embed_tokens.weight.device
    tokens = torch.tensor([job.prompt_ids + job.generated_ids], device=device)
    with torch.inference_mode():
        logits, _ = model(tokens)
    # The logits at position i predict token i + 1: the generated tokens are predicted from the
    # last prompt position onwards.
    first = len(job.prompt_ids) - 1
    predicted = logits[0, first : first + len(job.generated_ids)].argmax(dim=-1)
    expected = torch.tensor(job.generated_ids, device=device)
    return ShadowResult(tokens=len(job.generated_ids), agreements=int((predicted == expected).sum()))
