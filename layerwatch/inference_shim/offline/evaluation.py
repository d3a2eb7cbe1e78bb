"""Teacher-forced decoding with the real skip semantics: perplexity, skip rates, speed, entropies.

Held-out text is cut into windows. Each window's first `prefill_len - 1` tokens are prefilled at
full depth (as the engine prefills a prompt but its last token); then every remaining token is
fed one step at a time through the generation engine's own step, `gated_decode_step`: the run
mask comes from the SkipPolicy before the step (patience, protected layers, fallback), the KV
policy applies to skipped layers, and the policy observes the step's entropies after it.
Only the fed token is the text's own rather than a sampled one, so the next token's probability
is the text's: that gives perplexity under the decode semantics, not under a one-shot mask.

With no policy nothing is skipped. A policy with threshold 0 skips nothing either and gives
bit-identical logits, so "full" and "gated" differ only by what the policy skipped.

A batch of windows runs its layers as the engine's does (depth_execution.py): each row's skip rule
decides, and the depth execution runs layers whole or row by row. The totals count the rule's
decided skips (`skips_per_layer`, the `skip_fraction` eval always reported), the skips that really
happened (`executed_skips_per_layer`) and the layers run for rows whose rule skipped them
(`unneeded_runs_per_layer`), and how each (step, layer) ran (`paths`).

Speed is measured in pairs: `paired_decode` runs full depth and every policy on the same batch of
windows one after the other, rotating their order from batch to batch, and repeats the whole pass. On a
shared machine a slow spell then hits every configuration alike, so the gated ÷ full ratio of one
repetition is meaningful even when the absolute times are not; the spread over repetitions shows how much.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
import torch
import torch.nn.functional as F

from layerwatch.inference_shim.offline.gated_model import GatedModel
from layerwatch.inference_shim.runtime.depth_execution import (
    PATHS,
    DepthExecution,
    DepthExecutionConfig,
    MeasuredDepthCosts,
    layer_paths,
)
from layerwatch.inference_shim.runtime.engine import gated_decode_step
from layerwatch.inference_shim.runtime.model import KVCache, Transformer
from layerwatch.inference_shim.runtime.skip_policy import SkipPolicy
from layerwatch.skip_policy import SkipPolicyConfig


@dataclass
class DecodeStep:
    """One teacher-forced decode step over a batch of windows (host arrays)."""

    entropies: np.ndarray | None  # float32 [B, L], None without gates
    skipped: np.ndarray  # bool [B, L]: the skip rule skipped the layer (decided)
    executed_skipped: np.ndarray  # bool [B, L]: the layer did not run (executed)
    losses: np.ndarray  # float32 [B]: each row's negative log-likelihood of its next text token


@dataclass
class DecodeTotals:
    num_layers: int
    nll_sum: float = 0.0
    tokens: int = 0  # decode steps x rows: predicted tokens
    decode_seconds: float = 0.0  # wall time of the decode steps
    decode_cpu_seconds: float = 0.0  # process CPU time of the same steps (all threads)
    fallbacks: int = 0
    skips_per_layer: np.ndarray = field(init=False)  # int [L]: (token, layer) pairs the rule skipped
    executed_skips_per_layer: np.ndarray = field(init=False)  # int [L]: pairs the layer did not run for
    unneeded_runs_per_layer: np.ndarray = field(init=False)  # int [L]: pairs the rule skipped that ran
    paths: dict[str, int] = field(init=False)  # (step, layer) pairs by how the layer ran (PATHS)

    def __post_init__(self) -> None:
        self.skips_per_layer = np.zeros(self.num_layers, dtype=np.int64)
        self.executed_skips_per_layer = np.zeros(self.num_layers, dtype=np.int64)
        self.unneeded_runs_per_layer = np.zeros(self.num_layers, dtype=np.int64)
        self.paths = dict.fromkeys(PATHS, 0)

    def add_step(self, decided: np.ndarray, executed: np.ndarray) -> None:
        """One step's run masks, bool [B, L]: the rule's and what ran."""
        self.skips_per_layer += (~decided).sum(axis=0)
        self.executed_skips_per_layer += (~executed).sum(axis=0)
        self.unneeded_runs_per_layer += (executed & ~decided).sum(axis=0)
        for path, count in layer_paths(executed).items():
            self.paths[path] += count

    @property
    def perplexity(self) -> float:
        return math.exp(self.nll_sum / self.tokens)

    @property
    def skip_fraction(self) -> float:
        return float(self.skips_per_layer.sum()) / (self.tokens * self.num_layers)

    @property
    def executed_skip_fraction(self) -> float:
        return float(self.executed_skips_per_layer.sum()) / (self.tokens * self.num_layers)

    @property
    def unneeded_run_fraction(self) -> float:
        """Of all (token, layer) pairs, those the rule skipped and the batch ran."""
        return float(self.unneeded_runs_per_layer.sum()) / (self.tokens * self.num_layers)

    @property
    def per_layer_skip_rate(self) -> list[float]:
        return [float(s) / self.tokens for s in self.skips_per_layer]

    @property
    def tokens_per_second(self) -> float:
        return self.tokens / self.decode_seconds if self.decode_seconds > 0 else 0.0


def heldout_windows(stream: torch.Tensor, window_len: int, max_decode_tokens: int, prefill_len: int) -> torch.Tensor:
    """Consecutive non-overlapping windows [N, window_len], enough for `max_decode_tokens` predictions."""
    per_window = window_len - prefill_len
    if per_window < 1:
        raise ValueError(f"window length {window_len} leaves nothing to decode after a prefill of {prefill_len}")
    available = len(stream) // window_len
    if available == 0:
        raise ValueError(f"the text has {len(stream)} tokens, fewer than one window of {window_len}")
    count = min(available, math.ceil(max_decode_tokens / per_window))
    return stream[: count * window_len].view(count, window_len)


@torch.no_grad()
def teacher_forced_decode(
    model: Transformer,
    windows: torch.Tensor,
    prefill_len: int,
    policy_config: SkipPolicyConfig | None,
    kv_policy: str = "project",
    batch_size: int = 8,
    on_step: Callable[[DecodeStep], None] | None = None,
    totals: DecodeTotals | None = None,
    depth: DepthExecution | None = None,
) -> DecodeTotals:
    """Decode every window after its prefill; `policy_config=None` runs full depth. Adds to `totals`
    when given (several calls timed as one pass). `depth`: how a batch runs the layers its rows
    decided (None: every row exactly as it decided)."""
    if policy_config is not None and model.gates is None:
        raise ValueError("a skip policy needs gates: attach them to the model first")
    device = model.embed_tokens.weight.device
    totals = totals if totals is not None else DecodeTotals(num_layers=model.config.num_layers)
    for start in range(0, len(windows), batch_size):
        batch = windows[start : start + batch_size].to(device)
        _decode_batch(model, batch, prefill_len, policy_config, kv_policy, totals, on_step, depth)
    return totals


def _decode_batch(
    model: Transformer,
    batch: torch.Tensor,
    prefill_len: int,
    policy_config: SkipPolicyConfig | None,
    kv_policy: str,
    totals: DecodeTotals,
    on_step: Callable[[DecodeStep], None] | None,
    depth: DepthExecution | None,
) -> None:
    rows, window_len = batch.shape
    cache = KVCache(
        model.config, slots=rows, max_len=window_len, dtype=model.embed_tokens.weight.dtype, device=batch.device
    )
    context = prefill_len - 1  # the last prompt token is the first decode step's input
    if context > 0:  # a fresh cache: no slot needs a reset
        for slot in range(rows):
            model.prefill(batch[slot, :context], cache, slot)
    slots = np.arange(rows)
    policy = SkipPolicy(policy_config, model.config.num_layers, rows) if policy_config is not None else None
    for position in range(context, window_len - 1):
        started, started_cpu = time.perf_counter(), time.process_time()
        # Greedy `choose`: the text's own token is fed next, but the step still brings a token to
        # the host, as a generating step does.
        step = gated_decode_step(
            model,
            cache,
            policy,
            batch[:, position],
            slots,
            [position] * rows,
            kv_policy,
            choose=lambda logits: logits.argmax(dim=-1),
            depth=depth,
        )
        totals.decode_seconds += time.perf_counter() - started
        totals.decode_cpu_seconds += time.process_time() - started_cpu
        losses = F.cross_entropy(step.logits.float(), batch[:, position + 1], reduction="none").cpu().numpy()
        totals.nll_sum += float(losses.sum(dtype=np.float64))
        totals.tokens += rows
        totals.add_step(step.run_mask, step.executed)
        totals.fallbacks += int(step.fallback_started.sum())
        if on_step is not None:
            on_step(
                DecodeStep(
                    entropies=step.entropies if model.gates is not None else None,
                    skipped=~step.run_mask,
                    executed_skipped=~step.executed,
                    losses=losses,
                )
            )


@dataclass
class PairedRuns:
    """`paired_decode`'s totals: one DecodeTotals per repetition, for full depth and per policy."""

    policies: list[SkipPolicyConfig]
    full: list[DecodeTotals]  # [repeat]
    gated: list[list[DecodeTotals]]  # [policy][repeat]
    depth: DepthExecution  # how the gated batches ran their layers; its costs hold what was measured


def paired_decode(
    gated: GatedModel,
    windows: torch.Tensor,
    policies: list[SkipPolicyConfig],
    *,
    prefill: int,
    kv_policy: str,
    batch_size: int,
    repeats: int,
    depth: DepthExecutionConfig | DepthExecution | None = None,
) -> PairedRuns:
    """Full depth (gates detached: the ungated model) and each policy (e.g. a threshold sweep, or the
    skip rules side by side: `gated.policy(t, skip_rule=...)`), interleaved batch by batch. `depth`:
    the gated batches' depth execution (a config gets this model's measured costs; None: the
    default config); its costs are measured before anything is timed."""
    if repeats < 1:
        raise ValueError(f"repeats must be at least 1, got {repeats}")
    model = gated.model
    if not isinstance(depth, DepthExecution):
        depth = DepthExecution(depth or DepthExecutionConfig(), MeasuredDepthCosts(model, kv_policy))
    if depth.config.mode == "auto" and isinstance(depth.costs, MeasuredDepthCosts):
        depth.costs.prepare({len(windows[start : start + batch_size]) for start in range(0, len(windows), batch_size)})
    configs: list[SkipPolicyConfig | None] = [None, *policies]
    totals = [[DecodeTotals(num_layers=model.config.num_layers) for _ in range(repeats)] for _ in configs]
    for repeat in range(repeats):
        for batch_index, start in enumerate(range(0, len(windows), batch_size)):
            batch = windows[start : start + batch_size]
            first = (repeat + batch_index) % len(configs)  # each configuration takes each turn alike
            for index in [*range(first, len(configs)), *range(first)]:
                policy = configs[index]
                model.attach_gates(None if policy is None else gated.gates.gates)
                teacher_forced_decode(
                    model,
                    batch,
                    prefill,
                    policy,
                    kv_policy,
                    batch_size=batch_size,
                    totals=totals[index][repeat],
                    depth=depth,
                )
    return PairedRuns(list(policies), full=totals[0], gated=totals[1:], depth=depth)


def full_depth_runs(
    model: Transformer, windows: torch.Tensor, *, prefill: int, kv_policy: str, batch_size: int, repeats: int
) -> list[DecodeTotals]:
    """Full depth alone, `repeats` times (a model without gates: `eval --no-gates`)."""
    if repeats < 1:
        raise ValueError(f"repeats must be at least 1, got {repeats}")
    model.attach_gates(None)
    return [
        teacher_forced_decode(model, windows, prefill, None, kv_policy, batch_size=batch_size) for _ in range(repeats)
    ]


def full_depth_result(runs: list[DecodeTotals]) -> dict:
    """The `eval --no-gates --json` keys (docs/interfaces.md): quality from the first run, speed from all."""
    tokens_per_second = [r.tokens_per_second for r in runs]
    return {
        "perplexity_full": runs[0].perplexity,
        "tokens_per_second_full": float(np.median(tokens_per_second)),
        "speed": {"repeats": len(runs), "tokens_per_second_full": _spread(tokens_per_second)},
    }


def _spread(values: list[float]) -> dict:
    return {"median": float(np.median(values)), "min": min(values), "max": max(values), "runs": values}


def gated_result(runs: PairedRuns, policy_index: int) -> dict:
    """The `eval --json` keys for one policy (docs/interfaces.md). Quality comes from the first
    repetition (every repetition computes the same numbers); speed from all of them."""
    policy = runs.policies[policy_index]
    full_runs, gated_runs = runs.full, runs.gated[policy_index]
    full, gated = full_runs[0], gated_runs[0]
    tokens_per_second_full = [r.tokens_per_second for r in full_runs]
    tokens_per_second_gated = [r.tokens_per_second for r in gated_runs]
    return {
        "threshold": policy.threshold,
        "skip_rule": policy.skip_rule,
        "ewma_alpha": policy.ewma_alpha if policy.skip_rule == "ewma" else None,
        "perplexity_full": full.perplexity,
        "perplexity_gated": gated.perplexity,
        "perplexity_increase": gated.perplexity / full.perplexity - 1.0,
        "skip_fraction": gated.skip_fraction,
        "executed_skip_fraction": gated.executed_skip_fraction,
        "unneeded_run_fraction": gated.unneeded_run_fraction,
        "layer_paths": {path: count / max(1, sum(gated.paths.values())) for path, count in gated.paths.items()},
        "per_layer_skip_rate": gated.per_layer_skip_rate,
        "fallbacks": gated.fallbacks,
        "tokens_per_second_full": float(np.median(tokens_per_second_full)),
        "tokens_per_second_gated": float(np.median(tokens_per_second_gated)),
        "speed": {
            "repeats": len(full_runs),
            "tokens_per_second_full": _spread(tokens_per_second_full),
            "tokens_per_second_gated": _spread(tokens_per_second_gated),
            "cpu_seconds_full": [r.decode_cpu_seconds for r in full_runs],
            "cpu_seconds_gated": [r.decode_cpu_seconds for r in gated_runs],
            # Paired per repetition: gated ÷ full tokens/s by wall time and by CPU time.
            "gated_over_full": _spread(
                [g.tokens_per_second / f.tokens_per_second for f, g in zip(full_runs, gated_runs)]
            ),
            "gated_over_full_cpu": _spread(
                [f.decode_cpu_seconds / g.decode_cpu_seconds for f, g in zip(full_runs, gated_runs)]
            ),
        },
    }
