"""The shadow check's comparison: what the gated model said at generation time vs the full-depth model.

While a sampled request decodes, the engine records per generated position what the *gated* model's
own distribution said (`GatedRecord`, built on the device by `summarize_rows`): the raw distribution
of its logits at temperature 1, before the request's temperature, top-p, penalties and logit bias,
reduced to its argmax, the log-probability of the emitted token, its `SHADOW_TOP_K` most likely
tokens with their log-probabilities, and the log of the mass outside them. After the request, the
prompt + generated tokens go through the model's full-depth forward in one teacher-forced pass
(`full_depth_agreement`), and at each generated position:

- **agreement**: the full-depth argmax equals the gated argmax (for a plain greedy request the
  gated argmax is the emitted token, so this is the old "same top-1 as the output");
- **KL(gated || full)** in nats, the quality cost, computed exactly on the coarsened distributions
  over the partition {each of the gated top-K tokens alone} + {every other token, one bucket}
  (`partition_cells`, summed by layerwatch/shadow_divergence.py as the vLLM guard's are). Merging
  outcomes never increases a KL divergence (the data-processing inequality), so this is a lower
  bound of the true KL at that position, equal to it when the top K hold all the mass and close to
  it when they hold nearly all;
- **KL(full || gated)** on the same partition: its mean m over a model's text gives the perplexity
  increase the gated model would show on text the full-depth model writes, exp(m) - 1 (a lower
  bound, as above).

Both divergences are properties of the two models' distributions at the visited contexts; the
client's temperature, top-p, penalties and bias only choose which contexts (prefixes) are visited.
Also returned, as a cross-check only: the sample-based estimate sum of log p_gated(y) - log
p_full(y) over the emitted tokens y, unbiased for KL(gated || full) only when y was drawn from the
raw gated distribution (temperature 1, top_p 1, no penalties or bias).

The same pass can also measure every layer's signals on those positions (`layer_signals=True`, a
`LayerProbe` on the forward): how much the layer changed the residual stream, what its gate scored,
how discrete its attention was. The service uses them to check that the gates still track how much
their layer matters (layerwatch/inference_shim/service/layer_signals.py). The service's quality guard
(layerwatch/inference_shim/service/shadow.py) and `layerwatch calibrate` both measure this way.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from layerwatch.inference_shim.runtime.model import LayerProbe, Transformer
from layerwatch.shadow_divergence import SHADOW_TOP_K, partition_kl

__all__ = ["SHADOW_TOP_K"]  # tokens of the gated distribution kept per recorded position, re-exported


def summarize_rows(logits: torch.Tensor, emitted: torch.Tensor, k: int) -> torch.Tensor:
    """The record of each row of logits [F, V] that emitted token emitted[row], from the raw
    distribution log_softmax(logits): [F, 2 + 2k] float32 on the device (emitted log-probability,
    log-mass outside the top k, the top k ids, their log-probabilities; ids are exact in float32 below
    2^24). The few ops it takes are what recording costs a step (docs/performance.md). A row whose
    token is -1 (non-finite logits: the engine fails it) gets meaningless values."""
    logprobs = torch.log_softmax(logits.float(), dim=-1)
    k = min(k, logprobs.shape[-1])
    top_values, top_ids = logprobs.topk(k, dim=-1)
    chosen = logprobs.gather(-1, emitted.clamp_min(0)[:, None])
    rest = logprobs.scatter(-1, top_ids, float("-inf")).logsumexp(dim=-1, keepdim=True)
    return torch.cat([chosen, rest, top_ids.to(logprobs.dtype), top_values], dim=1)


@dataclass(frozen=True, eq=False)  # eq=False: ndarray fields
class GatedRecord:
    """The gated model's raw distribution at each of a sequence's G generated positions (module doc)."""

    emitted_logprob: np.ndarray  # float64 [G]: log p_gated of the token the sequence emitted
    rest_logprob: np.ndarray  # float64 [G]: log of the mass outside top_ids (-inf when they hold all of it)
    top_ids: np.ndarray  # int64 [G, K]: the K most likely tokens, most likely first
    top_logprobs: np.ndarray  # float64 [G, K]: their log-probabilities

    @classmethod
    def from_rows(cls, rows: list[np.ndarray], k: int) -> GatedRecord:
        """From `summarize_rows`' rows, one per generated position, in order (k as it used it: at most
        the vocabulary). No rows (a sequence cancelled before it generated): an empty record."""
        table = np.asarray(rows, dtype=np.float64).reshape(len(rows), 2 + 2 * k)
        return cls(
            emitted_logprob=table[:, 0].copy(),
            rest_logprob=table[:, 1].copy(),
            top_ids=table[:, 2 : 2 + k].astype(np.int64),
            top_logprobs=table[:, 2 + k : 2 + 2 * k].copy(),
        )

    @property
    def argmax(self) -> np.ndarray:
        """int64 [G]: the gated logits' argmax (temperature, top-p, penalties and bias not applied); of
        exactly tied logits, the one topk lists first."""
        return self.top_ids[:, 0]

    def __len__(self) -> int:
        return len(self.emitted_logprob)


@dataclass(frozen=True)
class ShadowJob:
    prompt_ids: list[int]
    generated_ids: list[int]
    record: GatedRecord  # what the gated model said at each generated position


@dataclass(frozen=True)
class LayerSignals:
    """Per generated position (the decode steps' input tokens) and layer, fp32 [G, L] on the host."""

    relative_update: np.ndarray  # ||dh|| / ||h|| of the layer's residual update
    attention_kl: np.ndarray  # KL(attention || uniform), mean over heads, nats
    gate_score: np.ndarray | None  # the layer's gate on the full-depth normed input; None without gates


@dataclass(frozen=True)
class ShadowResult:
    tokens: int
    agreements: int  # positions where the full-depth argmax is the gated argmax
    kl_nats: float = 0.0  # sum over positions of KL(gated || full) on the coarsened partition
    reverse_kl_nats: float = 0.0  # the same for KL(full || gated)
    # Cross-check: sum of log p_gated(y) - log p_full(y) over the emitted tokens (module doc).
    sampled_log_ratio: float = 0.0
    layer_signals: LayerSignals | None = None  # only when asked for


def partition_cells(
    top_ids: torch.Tensor, top_logprobs: torch.Tensor, rest_logprob: torch.Tensor, full_logprobs: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """(gated, full) log-probabilities [G, K + 1], float64, of the partition of the vocabulary into each of the
    gated top-K tokens and one bucket for the rest, computed on the device.

    top_ids [G, K], top_logprobs [G, K] and rest_logprob [G]: the gated record; full_logprobs [G, V]:
    the full-depth log_softmax at the same positions.
    """
    full = full_logprobs.double()
    full_top = full.gather(-1, top_ids)
    full_rest = full.scatter(-1, top_ids, float("-inf")).logsumexp(dim=-1)
    gated = torch.cat([top_logprobs.double(), rest_logprob.double()[:, None]], dim=-1)
    return gated, torch.cat([full_top, full_rest[:, None]], dim=-1)


def partition_divergences(
    top_ids: torch.Tensor, top_logprobs: torch.Tensor, rest_logprob: torch.Tensor, full_logprobs: torch.Tensor
) -> tuple[np.ndarray, np.ndarray]:
    """(KL(gated || full), KL(full || gated)) per position [G], float64, over `partition_cells`' partition
    (layerwatch/shadow_divergence.py sums them, as it does the vLLM guard's)."""
    gated, full = (cells.cpu().numpy() for cells in partition_cells(top_ids, top_logprobs, rest_logprob, full_logprobs))
    return partition_kl(gated, full), partition_kl(full, gated)


def full_depth_agreement(model: Transformer, job: ShadowJob, layer_signals: bool = False) -> ShadowResult:
    """Teacher-forced full-depth distributions over the generated positions, compared on the device
    with what the gated model recorded there (module doc); one transfer of the sums and the partition's
    cells to the host, where the divergences are summed.

    With `layer_signals`, also the layer signals of the positions whose logits are compared: the
    decode steps' inputs (the prompt's last token, then every generated token but the last).
    """
    generated = len(job.generated_ids)
    if len(job.record) != generated:
        raise ValueError(f"a record of {len(job.record)} positions for {generated} generated tokens")
    device = model.embed_tokens.weight.device
    tokens = torch.tensor([job.prompt_ids + job.generated_ids], device=device)
    # The logits at position i predict token i + 1: the generated tokens are predicted from the
    # last prompt position onwards.
    first = len(job.prompt_ids) - 1
    probe = LayerProbe(start=first) if layer_signals else None
    record = job.record
    with torch.inference_mode():
        logits, _ = model(tokens, probe=probe)
        full = torch.log_softmax(logits[0, first : first + generated].float(), dim=-1)
        gated_cells, full_cells = partition_cells(
            torch.as_tensor(record.top_ids, device=device),
            torch.as_tensor(record.top_logprobs, device=device),
            torch.as_tensor(record.rest_logprob, device=device),
            full,
        )
        agreements = (full.argmax(dim=-1) == torch.as_tensor(record.argmax, device=device)).sum()
        emitted = torch.tensor(job.generated_ids, device=device)
        log_ratio = torch.as_tensor(record.emitted_logprob, device=device) - full.gather(-1, emitted[:, None])[:, 0]
        # One transfer: the sums, then both sides' cells [G, K + 1].
        packed = (
            torch.cat(
                [
                    torch.stack([agreements.double(), log_ratio.double().sum()]),
                    gated_cells.flatten(),
                    full_cells.flatten(),
                ]
            )
            .cpu()
            .numpy()
        )
    cells = packed[2:].reshape(2, generated, -1)
    kl, reverse = partition_kl(cells[0], cells[1]), partition_kl(cells[1], cells[0])
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
    return ShadowResult(
        tokens=generated,
        agreements=int(packed[0]),
        kl_nats=float(kl.sum()),
        reverse_kl_nats=float(reverse.sum()),
        sampled_log_ratio=float(packed[1]),
        layer_signals=signals,
    )
