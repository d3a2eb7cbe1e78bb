"""Training the demo backbone from scratch: BPE tokenizer, token stream, LayerSkip-style layer dropout.

Layer dropout rising with depth (LayerSkip): during training, layer l's residual updates are dropped
for a token with probability p_l = p_max * l / (L - 1) (protected first and last layers: p = 0).
Dropping is per token, not per sequence, because that is what decoding does: one token skips a
layer while its neighbours run it, and the "project" KV policy still gives later tokens that
position's keys and values, just as `forward_full` does here for a dropped token.

Runs are resumable: the state (model, optimiser, data sampler, step) is written atomically every
few minutes, so an interrupted run loses little and continues where it stopped.
"""

from __future__ import annotations

import math
import os
import time
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from layerwatch.inference_shim.offline.corpus import CorpusError, read_documents
from layerwatch.inference_shim.runtime.model import ModelConfig, Transformer

if TYPE_CHECKING:
    from layerwatch.inference_shim.runtime.tokenizer import Tokenizer as TextTokenizer

BOS_TOKEN, EOS_TOKEN = "<|bos|>", "<|eos|>"
SPECIAL_TOKENS = (BOS_TOKEN, EOS_TOKEN)


# --- tokenizer -------------------------------------------------------------------------------------


def train_tokenizer(texts: Iterable[str], vocab_size: int) -> Tokenizer:
    """Byte-level BPE (GPT-2 style): every byte is representable, so no text is ever unknown."""
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(texts, trainer)
    return tokenizer


def encode_documents(tokenizer: Tokenizer, documents: list[str]) -> list[list[int]]:
    return [e.ids for e in tokenizer.encode_batch(documents, add_special_tokens=False)]


def token_stream(documents: Iterable[list[int]], bos_id: int | None, eos_id: int | None) -> torch.Tensor:
    """Tokenised documents as one int64 stream, each framed by BOS ... EOS (where the model has them)."""
    ids: list[int] = []
    for document in documents:
        if bos_id is not None:
            ids.append(bos_id)
        ids.extend(document)
        if eos_id is not None:
            ids.append(eos_id)
    return torch.tensor(ids, dtype=torch.long)


def text_file_stream(tokenizer: TextTokenizer, path: Path, min_tokens: int) -> torch.Tensor:
    """A plain-text file as one stream for a checkpoint's tokenizer; fails clearly when unusable."""
    documents = read_documents(path)
    eos = tokenizer.eos_token_ids[0] if tokenizer.eos_token_ids else None
    bos = tokenizer.bos_token_id if tokenizer.adds_bos else None  # frame documents as the tokenizer frames a prompt
    stream = token_stream((tokenizer.encode(d, add_special_tokens=False) for d in documents), bos, eos)
    if len(stream) < min_tokens:
        raise CorpusError(f"{path}: only {len(stream)} tokens, at least {min_tokens} are needed")
    return stream


def sample_windows(stream: torch.Tensor, batch_size: int, seq_len: int, generator: torch.Generator) -> torch.Tensor:
    """[batch_size, seq_len + 1] random windows: inputs are [:, :-1], targets [:, 1:]."""
    starts = torch.randint(0, len(stream) - seq_len - 1, (batch_size,), generator=generator)
    return torch.stack([stream[s : s + seq_len + 1] for s in starts.tolist()])


# --- layer dropout ---------------------------------------------------------------------------------


def layer_drop_probabilities(num_layers: int, max_drop: float, protected: tuple[int, ...]) -> list[float]:
    probabilities = [max_drop * l / max(num_layers - 1, 1) for l in range(num_layers)]
    for l in protected:
        probabilities[l] = 0.0
    return probabilities


def layer_dropout(probabilities: list[float], generator: torch.Generator):
    """An `update_scale` hook: per token, keep layer l's updates with probability 1 - p_l."""

    def scale(layer: int, x: torch.Tensor) -> torch.Tensor | None:
        p = probabilities[layer]
        if p == 0.0:
            return None
        keep = torch.rand(x.shape[:-1] + (1,), generator=generator) >= p
        return keep.to(x.dtype)

    return scale


# --- the backbone run ------------------------------------------------------------------------------


@dataclass(frozen=True)
class BackboneSchedule:
    steps: int
    batch_size: int = 16
    seq_len: int = 128
    learning_rate: float = 3e-3
    min_learning_rate_ratio: float = 0.1  # cosine decays to this fraction of the peak
    warmup_steps: int = 200
    weight_decay: float = 0.1
    max_layer_drop: float = 0.5  # p_max of the rising layer dropout
    seed: int = 0

    def learning_rate_at(self, step: int) -> float:
        if step < self.warmup_steps:
            return self.learning_rate * (step + 1) / self.warmup_steps
        progress = (step - self.warmup_steps) / max(self.steps - self.warmup_steps, 1)
        cosine = 0.5 * (1 + math.cos(math.pi * min(progress, 1.0)))
        floor = self.min_learning_rate_ratio
        return self.learning_rate * (floor + (1 - floor) * cosine)


def lm_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))


def make_optimizer(model: Transformer, schedule: BackboneSchedule) -> torch.optim.AdamW:
    # No weight decay on norms and biases (nanoGPT's rule: decay only matrices).
    params = [p for p in model.parameters() if p.requires_grad]
    decay = [p for p in params if p.dim() >= 2]
    no_decay = [p for p in params if p.dim() < 2]
    groups = [{"params": decay, "weight_decay": schedule.weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=schedule.learning_rate, betas=(0.9, 0.95))


@dataclass
class TrainState:
    model: Transformer
    optimizer: torch.optim.AdamW
    generator: torch.Generator
    step: int = 0
    elapsed_seconds: float = 0.0


def save_state(state: TrainState, schedule: BackboneSchedule, path: Path) -> None:
    """Atomic: a crash while writing leaves the previous state intact."""
    payload = {
        "config": state.model.config.to_dict(),
        "schedule": asdict(schedule),
        "model": state.model.state_dict(),
        "optimizer": state.optimizer.state_dict(),
        "generator": state.generator.get_state(),
        "step": state.step,
        "elapsed_seconds": state.elapsed_seconds,
    }
    tmp = path.with_suffix(".tmp")
    torch.save(payload, tmp)
    os.replace(tmp, path)


def load_state(path: Path) -> tuple[TrainState, BackboneSchedule]:
    payload = torch.load(path, map_location="cpu", weights_only=False)
    config_dict = dict(payload["config"])
    config_dict["eos_token_ids"] = tuple(config_dict.get("eos_token_ids") or ())
    model = Transformer(ModelConfig(**config_dict))
    model.load_state_dict(payload["model"])
    schedule = BackboneSchedule(**payload["schedule"])
    optimizer = make_optimizer(model, schedule)
    optimizer.load_state_dict(payload["optimizer"])
    generator = torch.Generator()
    generator.set_state(payload["generator"])
    return TrainState(model, optimizer, generator, payload["step"], payload["elapsed_seconds"]), schedule


def new_state(config: ModelConfig, schedule: BackboneSchedule) -> TrainState:
    torch.manual_seed(schedule.seed)
    model = Transformer(config)
    init_weights(model)
    generator = torch.Generator().manual_seed(schedule.seed)
    return TrainState(model, make_optimizer(model, schedule), generator)


def init_weights(model: Transformer) -> None:
    """GPT-2 init: N(0, 0.02), residual output projections scaled down by sqrt(2L)."""
    residual_std = 0.02 / math.sqrt(2 * model.config.num_layers)
    for name, p in model.named_parameters():
        if p.dim() < 2:
            continue
        std = residual_std if name.endswith(("o_proj.weight", "down_proj.weight")) else 0.02
        torch.nn.init.normal_(p, mean=0.0, std=std)


@torch.no_grad()
def evaluate_loss(model: Transformer, stream: torch.Tensor, seq_len: int, max_windows: int) -> float:
    """Mean full-depth LM loss over consecutive windows of the stream."""
    model.eval()
    usable = (len(stream) - 1) // seq_len
    losses = []
    for i in range(min(usable, max_windows)):
        window = stream[i * seq_len : (i + 1) * seq_len + 1][None]
        logits, _ = model(window[:, :-1])
        losses.append(lm_loss(logits, window[:, 1:]).item())
    model.train()
    return sum(losses) / len(losses)


def train_backbone(
    state: TrainState,
    schedule: BackboneSchedule,
    stream: torch.Tensor,
    heldout: torch.Tensor,
    checkpoint_path: Path,
    *,
    checkpoint_every_seconds: float = 180.0,
    log: Callable[[str], None] = print,
    log_every: int = 50,
) -> TrainState:
    """Train until `schedule.steps`, checkpointing every few minutes and at the end."""
    model = state.model
    model.train()
    config = model.config
    drop = layer_drop_probabilities(config.num_layers, schedule.max_layer_drop, (0, config.num_layers - 1))
    update_scale = layer_dropout(drop, state.generator)
    last_save = time.monotonic()
    window_start, window_loss, window_steps = time.monotonic(), 0.0, 0
    while state.step < schedule.steps:
        step_start = time.monotonic()
        lr = schedule.learning_rate_at(state.step)
        for group in state.optimizer.param_groups:
            group["lr"] = lr
        batch = sample_windows(stream, schedule.batch_size, schedule.seq_len, state.generator)
        logits, _ = model(batch[:, :-1], update_scale=update_scale)
        loss = lm_loss(logits, batch[:, 1:])
        state.optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        state.optimizer.step()
        state.step += 1
        state.elapsed_seconds += time.monotonic() - step_start
        window_loss += loss.item()
        window_steps += 1
        if state.step % log_every == 0 or state.step == schedule.steps:
            rate = window_steps * schedule.batch_size * schedule.seq_len / (time.monotonic() - window_start)
            log(
                f"step {state.step}/{schedule.steps} loss {window_loss / window_steps:.4f} lr {lr:.2e} "
                f"tokens/s {rate:.0f} elapsed {state.elapsed_seconds / 60:.1f} min"
            )
            window_start, window_loss, window_steps = time.monotonic(), 0.0, 0
        if time.monotonic() - last_save >= checkpoint_every_seconds or state.step == schedule.steps:
            save_state(state, schedule, checkpoint_path)
            last_save = time.monotonic()
            held = evaluate_loss(model, heldout, schedule.seq_len, max_windows=16)
            log(f"checkpoint step {state.step}: held-out loss {held:.4f} (ppl {math.exp(held):.1f})")
    return state
