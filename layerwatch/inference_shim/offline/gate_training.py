"""Training gate heads on a frozen backbone (docs/gate-training.md explains the objective).

What decoding does, training mimics: layer l is skipped for token t when its gate scored below
the threshold tau at each of the previous `patience` tokens. Here every gate's "score is high"
event is relaxed into a Gumbel-sigmoid sample

    high_t = sigmoid((sharpness * (logit_t - logit(tau)) + logistic noise) / temperature),

a layer's update for token t is scaled by  keep_t = 1 - prod_{j=1..patience} (1 - high_{t-j}),
and the loss is

    LM loss  +  sparsity_weight * (mean skip - target_skip)^2  +  commit_weight * double_well(logit).

Under the "ewma" skip rule (`skip_rule`), the event relaxed is "the moving average of the
previous tokens' scores is high" instead: the average of the gate scores, a linear function of
them (`moving_average`), is compared with tau the same way, and token t is skipped by the average
up to token t - 1, from token `patience` on (`average_skip`).

The temperature anneals towards zero so the relaxed skip becomes the hard one; the target skip
sets the rate; the double well pulls every score towards one of two values on either side of tau
(`low_score`, `high_score`), which gives the two humps a healthy entropy histogram has, and keeps
the scores away from tau, where a little noise would flip decisions. The double well's weight
ramps up from zero over the first half of the run, so the gates first find where skipping is
cheap and then commit. Protected layers are never skipped; their gates are only held at the high
score.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path

import torch
import torch.nn.functional as F

from layerwatch import argtypes
from layerwatch.inference_shim.offline.importance_gates import (
    ImportanceStats,
    calibrate_to_rate,
    fit_gates,
    hold_at,
    score_windows,
)
from layerwatch.inference_shim.offline.training import lm_loss, sample_windows, text_file_stream
from layerwatch.inference_shim.runtime.checkpoint import load_checkpoint, resolve_device
from layerwatch.inference_shim.runtime.gates import GateMetadata, model_fingerprint, save_gates
from layerwatch.inference_shim.runtime.model import GateBank, Transformer
from layerwatch.inference_shim.runtime.skip_policy import decide_sequences
from layerwatch.settings import setting
from layerwatch.skip_policy import SKIP_RULES, SkipPolicyConfig

_FINITE_FIELDS = (
    "learning_rate",
    "target_skip",
    "sparsity_weight",
    "commit_weight",
    "low_score",
    "high_score",
    "sharpness",
    "start_temperature",
    "end_temperature",
)


GATE_METHODS = ("relaxed", "importance")


@dataclass(frozen=True)
class GateSchedule:
    """How gates are trained, one flag of `layerwatch train-gates` per knob (the relaxation's sharpness and
    temperatures have none); refuses a number training cannot use, before any model loads."""

    method: str = setting(
        "relaxed",
        choices=GATE_METHODS,
        help="relaxed: train the relaxed skip decision through the model (the demo's recipe); importance: "
        "score each layer's per-token cost of a skip once with the frozen model, then fit the gates to it "
        "(fast on real models; docs/gate-training.md)",
    )
    steps: int = setting(1200, type=int, help="training steps (importance: batches of windows scored)")
    batch_size: int = setting(8, type=int, help="text windows per step")
    seq_len: int = setting(128, type=int, help="tokens per window")
    learning_rate: float = setting(5e-3, type=float, help="AdamW's starting rate, decayed over the run (cosine)")
    threshold: float = setting(  # stored in the gate file
        SkipPolicyConfig.threshold, type=argtypes.fraction, help="tau the gates are trained for"
    )
    patience: int = setting(SkipPolicyConfig.patience, type=int, help="the skip rule's patience trained for")
    skip_rule: str = setting(  # stored in the gate file
        SkipPolicyConfig.skip_rule,
        choices=SKIP_RULES,
        help="the skip rule the gates are trained for and that their file names: streak (--patience "
        "consecutive low scores) or ewma (the scores' moving average low, after --patience warm-up steps)",
    )
    ewma_alpha: float = setting(
        SkipPolicyConfig.ewma_alpha,
        type=argtypes.positive_fraction,
        metavar="A",
        help="the ewma rule's weight of the newest score, in (0, 1]",
    )
    protected_layers: tuple[int, ...] = ()
    target_skip: float = setting(0.28, type=float, help="share of (token, skippable layer) pairs the gates should skip")
    sparsity_weight: float = setting(
        20.0, type=float, help="weight of the squared gap between the skipped share and --target-skip"
    )
    commit_weight: float = setting(
        2.0, type=float, help="weight of the double-well penalty that pulls scores to --low-score/--high-score"
    )
    low_score: float = setting(
        0.10, type=argtypes.open_fraction, help="the double well's lower minimum, in (0, 1) and below --threshold"
    )
    high_score: float = setting(
        0.30, type=argtypes.open_fraction, help="the double well's upper minimum, in (0, 1) and above --threshold"
    )
    sharpness: float = 5.0  # decision logit per unit of gate logit
    start_temperature: float = 1.0
    end_temperature: float = 0.1
    fit_epochs: int = setting(20, type=int, help="importance: passes of the gate fit over the scores")
    seed: int = setting(0, type=int, help="seed of the gates' initial weights, the windows drawn and the noise")

    def __post_init__(self) -> None:
        if self.method not in GATE_METHODS:
            raise ValueError(f"--method must be one of {', '.join(GATE_METHODS)}, got {self.method!r}")
        # NaN compares false with every limit: a NaN weight trained and wrote a gate file, exit 0.
        for name in _FINITE_FIELDS:
            if not math.isfinite(getattr(self, name)):
                raise ValueError(f"--{name.replace('_', '-')} must be a finite number, got {getattr(self, name)}")
        for name in ("steps", "batch_size", "seq_len", "fit_epochs"):
            if getattr(self, name) < 1:
                raise ValueError(f"--{name.replace('_', '-')} must be at least 1, got {getattr(self, name)}")
        # The skip rule looks back --patience scores in a window (and the importance method scores all
        # but its last token): a window no longer than that was a tensor-shape traceback.
        if self.seq_len <= self.patience:
            raise ValueError(f"--seq-len must be longer than --patience ({self.patience}), got {self.seq_len}")
        # The double well's minima lie on either side of tau (skipped, computed), each a finite logit:
        # --high-score 1 was a ZeroDivisionError, 0 or 2 a "math domain error" naming no flag, and a low
        # score above the high one trained and wrote a file.
        if not 0 < self.low_score < self.threshold < self.high_score < 1:
            raise ValueError(
                f"--low-score ({self.low_score}) < --threshold ({self.threshold}) < --high-score ({self.high_score}) "
                "must hold, all in (0, 1)"
            )
        if not 0 <= self.target_skip <= 1:
            raise ValueError(f"--target-skip is a share of (token, layer) pairs in [0, 1], got {self.target_skip}")

    def temperature_at(self, step: int) -> float:
        """Geometric annealing from start to end over the run."""
        progress = step / max(self.steps - 1, 1)
        return self.start_temperature * (self.end_temperature / self.start_temperature) ** progress

    def commit_weight_at(self, step: int) -> float:
        """The double well grows in over the first half: gates first learn where to skip, then commit."""
        return self.commit_weight * min(1.0, 2 * step / max(self.steps, 1))

    def learning_rate_at(self, step: int) -> float:
        return self.learning_rate * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * step / max(self.steps, 1))))


def init_gates(num_layers: int, hidden_size: int, schedule: GateSchedule) -> GateBank:
    """Default Linear init; output bias at tau for skippable layers, so each starts undecided and the
    relaxed skip (a product of `patience` low-score events) has gradient. Protected layers start,
    and stay, at the high score."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(schedule.seed)
        gates = GateBank(num_layers, hidden_size)
    with torch.no_grad():
        for layer in range(len(gates)):
            start = schedule.high_score if layer in schedule.protected_layers else schedule.threshold
            gates[layer].fc2.bias.fill_(_logit(start))
    return gates


def _logit(p: float) -> float:
    return math.log(p / (1 - p))


def patience_skip(high: torch.Tensor, patience: int) -> torch.Tensor:
    """[B, T] relaxed "score was high" -> [B, T] relaxed "skipped": low at each of the previous
    `patience` tokens. The first `patience` tokens have no such history and never skip."""
    low = 1.0 - high
    skip = torch.ones_like(low)
    for j in range(1, patience + 1):
        skip = skip * F.pad(low[:, :-j], (j, 0), value=0.0)
    return skip


def moving_average(scores: torch.Tensor, alpha: float) -> torch.Tensor:
    """[B, T] scores -> [B, T]: the ewma rule's average after each token, average_t = alpha *
    score_t + (1 - alpha) * average_{t-1}, average_0 = score_0; one matmul with the decay weights."""
    t = torch.arange(scores.shape[-1], device=scores.device)
    age = (t[:, None] - t[None, :]).to(scores.dtype)  # [T, T]: how many tokens ago score j came
    weights = alpha * (1.0 - alpha) ** age.clamp(min=0)
    weights[:, 0] = (1.0 - alpha) ** t.to(scores.dtype)  # the first score starts the average
    return scores @ weights.tril().T


def average_skip(high: torch.Tensor, patience: int) -> torch.Tensor:
    """[B, T] relaxed "the average up to token t was high" -> [B, T] relaxed "skipped": the average
    up to the previous token was low. The first `patience` tokens (warm-up) never skip."""
    skip = F.pad(1.0 - high[:, :-1], (1, 0), value=0.0)
    warm = torch.arange(high.shape[-1], device=high.device) >= patience
    return skip * warm


def hard_skip_fraction(scores: torch.Tensor, schedule: GateSchedule) -> float:
    """[..., T] scores of consecutive tokens -> the share of them the schedule's skip rule skips at
    its threshold: decoding's own rule (`decide_sequences`), each row one layer's sequence, with no
    protected layer and no fallback breaker (the relaxation above has neither)."""
    rows = scores.detach().reshape(-1, scores.shape[-1]).double().cpu().numpy()
    config = SkipPolicyConfig(
        threshold=schedule.threshold,
        patience=schedule.patience,
        protected_layers=(),
        fallback_skip_fraction=1.0,  # no step skips more than every layer: the breaker never starts
        skip_rule=schedule.skip_rule,
        ewma_alpha=schedule.ewma_alpha,
    )
    return float(decide_sequences(config, rows[:, :, None]).mean())


def fit_importance_gates(
    model: Transformer,
    gates: GateBank,
    stream: torch.Tensor,
    schedule: GateSchedule,
    on_progress: Callable[[ImportanceStats], None] | None = None,
) -> GateBank:
    """The importance method (importance_gates.py): score `steps` batches of windows with the frozen
    `model`, fit the skippable layers' gates, calibrate them to `target_skip` under the skip rule."""
    generator = torch.Generator().manual_seed(schedule.seed)
    skippable = tuple(l for l in range(len(gates)) if l not in schedule.protected_layers)
    sample = score_windows(
        model,
        stream,
        schedule.steps,
        schedule.batch_size,
        schedule.seq_len,
        skippable,
        generator,
        on_batch=on_progress,
    )
    gates.to(next(model.parameters()).device).train()
    fit_gates(gates, sample, schedule.fit_epochs, schedule.learning_rate, generator, on_epoch=on_progress)
    calibrate_to_rate(
        gates,
        sample,
        lambda scores: hard_skip_fraction(scores, schedule),
        schedule.threshold,
        schedule.target_skip,
        schedule.low_score,
    )
    hold_at(gates, schedule.protected_layers, schedule.high_score)
    return gates.eval()


class GatedForward:
    """The `update_scale` hook of one training step; remembers the gate logits and relaxed skips."""

    def __init__(
        self,
        gates: GateBank,
        schedule: GateSchedule,
        protected: set[int],
        temperature: float,
        generator: torch.Generator,
    ) -> None:
        self.gates, self.schedule, self.protected = gates, schedule, protected
        self.temperature, self.generator = temperature, generator
        self.logits: list[torch.Tensor] = []
        self.skips: list[torch.Tensor] = []

    def __call__(self, layer: int, x: torch.Tensor) -> torch.Tensor | None:
        logit = self.gates[layer].logit(x)  # [B, T]
        self.logits.append(logit)
        if layer in self.protected:
            return None
        s = self.schedule
        u = torch.rand(logit.shape, generator=self.generator, device=logit.device).clamp(1e-6, 1 - 1e-6)
        noise = torch.log(u) - torch.log1p(-u)
        if s.skip_rule == "ewma":
            average = moving_average(torch.sigmoid(logit), s.ewma_alpha)
            decision = s.sharpness * (torch.logit(average, eps=1e-6) - _logit(s.threshold))
            skip = average_skip(torch.sigmoid((decision + noise) / self.temperature), s.patience)
        else:
            decision = s.sharpness * (logit - _logit(s.threshold))
            skip = patience_skip(torch.sigmoid((decision + noise) / self.temperature), s.patience)
        self.skips.append(skip)
        return (1.0 - skip)[..., None].to(x.dtype)

    def double_well(self) -> torch.Tensor:
        """Squared distance of each gate logit to the nearer of the two wells (protected layers: high)."""
        low, high = _logit(self.schedule.low_score), _logit(self.schedule.high_score)
        logits = torch.stack(self.logits)  # [L, B, T]
        to_high = (logits - high) ** 2
        nearer = torch.minimum((logits - low) ** 2, to_high)
        protected = torch.tensor([l in self.protected for l in range(len(self.logits))], device=logits.device)
        return torch.where(protected[:, None, None], to_high, nearer).mean()

    def skip_fraction(self) -> torch.Tensor:
        return torch.stack(self.skips).mean() if self.skips else torch.zeros(())


@dataclass
class GateStepStats:
    step: int
    loss: float
    lm_loss: float
    skip_fraction: float
    temperature: float


def train_gates(
    model: Transformer,
    gates: GateBank,
    stream: torch.Tensor,
    schedule: GateSchedule,
    on_step: Callable[[GateStepStats], None] | None = None,
) -> GateBank:
    """Train `gates` in place on a frozen `model` over random windows of the token stream."""
    device = next(model.parameters()).device
    model.eval()  # no dropout in the model; gates are the only thing that learns
    for p in model.parameters():
        p.requires_grad_(False)
    model.attach_gates(None)  # entropies come from our hook, not from forward's own gate pass
    gates.to(device).train()
    optimizer = torch.optim.AdamW(gates.parameters(), lr=schedule.learning_rate, weight_decay=0.0)
    generator = torch.Generator().manual_seed(schedule.seed)
    noise_generator = torch.Generator(device=device).manual_seed(schedule.seed + 1)
    protected = set(schedule.protected_layers)
    for step in range(schedule.steps):
        for group in optimizer.param_groups:
            group["lr"] = schedule.learning_rate_at(step)
        temperature = schedule.temperature_at(step)
        batch = sample_windows(stream, schedule.batch_size, schedule.seq_len, generator).to(device)
        hook = GatedForward(gates, schedule, protected, temperature, noise_generator)
        logits, _ = model(batch[:, :-1], update_scale=hook)
        language = lm_loss(logits, batch[:, 1:])
        skip = hook.skip_fraction()
        loss = (
            language
            + schedule.sparsity_weight * (skip - schedule.target_skip) ** 2
            + schedule.commit_weight_at(step) * hook.double_well()
        )
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        if on_step is not None:
            on_step(GateStepStats(step + 1, loss.item(), language.item(), skip.item(), temperature))
    return gates.eval()


def train_gate_file(
    model_dir: Path,
    data: Path,
    out: Path,
    schedule: GateSchedule,
    *,
    device: str = "cpu",
    on_step: Callable[[GateStepStats], None] | None = None,
    on_progress: Callable[[ImportanceStats], None] | None = None,
) -> str:
    """Train gates for the frozen checkpoint in `model_dir` on the text file `data` and write them to
    `out`, with the skip policy they were trained for (threshold, patience, rule); returns the
    file's sha256. With no protected layers in the schedule, the skip policy's default ones (first
    and last) are kept at full depth. Raises CheckpointError, CorpusError or ValueError on bad input."""
    loaded = load_checkpoint(model_dir, device=resolve_device(device))
    stream = text_file_stream(loaded.tokenizer, data, min_tokens=schedule.seq_len + 2)
    model, config = loaded.model, loaded.config
    policy = SkipPolicyConfig(
        threshold=schedule.threshold,
        patience=schedule.patience,
        skip_rule=schedule.skip_rule,
        ewma_alpha=schedule.ewma_alpha,
    )  # refuses a bad rule or alpha before training
    if not schedule.protected_layers:
        schedule = replace(schedule, protected_layers=policy.protected(config.num_layers))
    gates = init_gates(config.num_layers, config.hidden_size, schedule)
    if schedule.method == "importance":
        fit_importance_gates(model, gates, stream, schedule, on_progress=on_progress)
    else:
        train_gates(model, gates, stream, schedule, on_step=on_step)
    metadata = GateMetadata(
        num_layers=config.num_layers,
        hidden_size=config.hidden_size,
        threshold=schedule.threshold,
        patience=schedule.patience,
        base_fingerprint=model_fingerprint(model),
        skip_rule=schedule.skip_rule,
        ewma_alpha=schedule.ewma_alpha,
    )
    return save_gates(out, gates, metadata)
