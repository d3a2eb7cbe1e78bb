"""Batched generation with per-sequence layer skipping: the engine the service and `eval` drive.

One `step()` admits waiting sequences (prefill at full depth), then runs ONE decode step for all
active rows. Each row is a sequence in its own KV-cache slot. The step's run mask comes from the
skip policy's host-side state, so it is known before the step starts; the step then does one
device->host transfer, after the last layer (next tokens and entropies together), which feeds the
policy for the *next* step (a step in which a row asks for log-probabilities reads them in a second
transfer, also after the last layer). Nothing inside a step waits on the device to decide a skip.
How the batch then runs the layers its rows decided (row by row, whole, or by a batch consensus) is
the depth execution's plan (depth_execution.py), which never makes a layer cost more than at full
depth; each row's decided mask still feeds its skip policy and its step record's `skipped`, and
`executed_skipped` says what ran. That step is `gated_decode_step`; teacher-forced evaluation calls
it too, so both share its semantics.

A sequence submitted with `record=True` (the shadow check's sample, layerwatch/inference_shim/service/shadow.py)
also has, per generated position, a summary of the gated model's own distribution computed on the
device for its row only (layerwatch/inference_shim/runtime/agreement.py, `summarize_rows`) and packed into the
step's one transfer; its final update carries them (`SequenceUpdate.gated_record`).

A sequence that asks for its prompt's log-probabilities is *scored* before it generates: its prompt
is fed one decode step at a time (teacher-forced, from its first token on, as `layerwatch eval
--prefill 1` feeds a window), in the batch with the other rows, so every prompt token's
log-probability comes from the gated model as served, skips included. Then the slot is refilled
by the usual full-depth prefill, so what it generates does not depend on having been scored.

Token accounting: prefill runs the prompt except its last token. Decode step i of a sequence
feeds its (i-1)-th generated token (the prompt's last token at i = 0) and produces the i-th, so
N generated tokens = N decode steps, each with one StepRecord row. Generated tokens include a
final EOS token or the token that completed a stop string; neither appears in the text. A scored
prompt of T tokens takes T - 1 more decode steps of its sequence, which read the prompt (as
prefill does) and so are not in the StepRecords.

What one sequence raises (its prefill, sampling, log-probabilities, decoding) ends that sequence
with finish_reason "error" and the rest of the batch goes on; only a failure of the batched model
step itself raises out of `step()`.

The engine is single-threaded: the service calls it from one worker thread.
"""

from __future__ import annotations

import json
import logging
import random
import time
from collections import Counter, deque
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
import torch

from layerwatch.inference_shim.runtime.agreement import SHADOW_TOP_K, GatedRecord, summarize_rows
from layerwatch.inference_shim.runtime.depth_execution import (
    DepthExecution,
    DepthExecutionConfig,
    MeasuredDepthCosts,
    default_depth_execution,
)
from layerwatch.inference_shim.runtime.model import KV_POLICIES, KVCache, Transformer
from layerwatch.inference_shim.runtime.skip_policy import SkipPolicy
from layerwatch.inference_shim.runtime.tokenizer import IncrementalDecoder, Tokenizer
from layerwatch.skip_policy import SkipPolicyConfig, check_threshold

log = logging.getLogger(__name__)

DEFAULT_MAX_SEQ_LEN = 4096  # cache length when neither the caller nor a shorter model limit sets one
MAX_LOGPROBS = 20  # most alternatives per token (vLLM's default limit; OpenAI's chat API allows 20)
MAX_PENALTY = 2.0  # presence and frequency penalties lie in [-2, 2] (OpenAI's range)
MAX_LOGIT_BIAS = 100.0  # a logit bias lies in [-100, 100] (OpenAI's range)
# The fallback log line's marker, the field's (docs/alerting.md, "The field's reports"); key=value pairs follow.
FALLBACK_MARKER = "ILP_FALLBACK: HIGH_SKIPPING"
NON_FINITE_LOGITS = "the model produced non-finite logits (NaN or inf) for this sequence"
EVERY_TOKEN_BANNED = "allowed_token_ids and bad_words left no token to draw at this step"
# What `_sample` puts in a row's token when it has none: the host then fails that sequence alone.
NO_TOKEN = {-1: NON_FINITE_LOGITS, -2: EVERY_TOKEN_BANNED}
FLOAT32_TINY = float(torch.finfo(torch.float32).tiny)
# The most likely tokens a top-p nucleus is first cut from (sample_token).
NUCLEUS_CANDIDATES = 1024


@dataclass
class SamplingParams:
    max_tokens: int = 64  # 0: generate nothing (with prompt_logprobs: only score the prompt)
    temperature: float = 0.0  # 0 = greedy
    top_p: float = 1.0
    seed: int | None = None  # same seed -> same tokens, whatever else shares the batch (depth execution "rows")
    stop: tuple[str, ...] = ()
    # OpenAI's penalties, over the tokens generated so far: presence once per distinct token,
    # frequency once per occurrence, both subtracted from the token's logit.
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: dict[int, float] = field(default_factory=dict)  # token id -> added to its logit
    # vLLM's token bans: only these tokens may be drawn (None: any), and never the last token of a
    # banned token sequence whose other tokens end what was generated (a one-token sequence: never).
    allowed_token_ids: tuple[int, ...] | None = None
    bad_words: tuple[tuple[int, ...], ...] = ()
    ignore_eos: bool = False  # run to max_tokens through EOS tokens (vLLM's option, for benchmarks)
    logprobs: int | None = None  # each generated token's log-probability and its k most likely alternatives
    # The same for the prompt's tokens from the second on, from teacher-forced decode steps (module doc).
    prompt_logprobs: int | None = None

    def validate(self) -> None:
        if self.max_tokens < 0:
            raise ValueError(f"max_tokens must be >= 0, got {self.max_tokens}")
        if not self.temperature >= 0.0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if any(not s for s in self.stop):
            raise ValueError("stop strings must not be empty")
        for name in ("presence_penalty", "frequency_penalty"):
            if not -MAX_PENALTY <= getattr(self, name) <= MAX_PENALTY:
                raise ValueError(f"{name} must be in [-{MAX_PENALTY:g}, {MAX_PENALTY:g}], got {getattr(self, name)}")
        if not all(-MAX_LOGIT_BIAS <= bias <= MAX_LOGIT_BIAS for bias in self.logit_bias.values()):
            raise ValueError(f"logit_bias values must be in [-{MAX_LOGIT_BIAS:g}, {MAX_LOGIT_BIAS:g}]")
        if self.allowed_token_ids is not None and not self.allowed_token_ids:
            raise ValueError("allowed_token_ids must allow at least one token")
        if any(not word for word in self.bad_words):
            raise ValueError("bad_words token sequences must not be empty")
        for name in ("logprobs", "prompt_logprobs"):
            k = getattr(self, name)
            if k is not None and not 0 <= k <= MAX_LOGPROBS:
                raise ValueError(f"{name} must be in 0..{MAX_LOGPROBS}, got {k}")

    def adjusts_logits(self) -> bool:
        return bool(self.presence_penalty or self.frequency_penalty or self.logit_bias or self.bans_tokens())

    def bans_tokens(self) -> bool:
        return self.allowed_token_ids is not None or bool(self.bad_words)

    def token_ids(self) -> dict[str, list[int]]:
        """The token ids each field names (the engine checks them against the vocabulary)."""
        return {
            "logit_bias": list(self.logit_bias),
            "allowed_token_ids": list(self.allowed_token_ids or ()),
            "bad_words": [token for word in self.bad_words for token in word],
        }


@dataclass(frozen=True)
class TokenLogprob:
    """A token's log-probability under the model's own distribution (before temperature, top-p,
    penalties and bias), and the `k` most likely tokens at that position."""

    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...]  # (token id, logprob), most likely first


@dataclass
class StepRecord:
    """One decode step, plain host data. Rows are the sequences active in the step."""

    step: int  # engine-wide decode step counter, from 1
    sequence_ids: np.ndarray  # int64 [B]
    token_ids: np.ndarray  # int64 [B]: tokens fed to this step
    next_token_ids: np.ndarray  # int64 [B]: tokens this step produced
    entropies: np.ndarray  # float32 [B, L]: every layer's gate entropy, skipped or not (NaN: no gates)
    skipped: np.ndarray  # bool [B, L]: True = the skip rule skipped the layer for that row (decided)
    # bool [B, L]: True = the layer did not run for that row (executed: the depth execution may run a
    # layer the rule skipped, for the batch's sake, or with a batch consensus skip one it kept)
    executed_skipped: np.ndarray
    batch_skipped: np.ndarray  # bool [L]: no row of the step ran the layer (only these save weight reads)
    fallback: np.ndarray  # bool [B]: the row ran full depth because of a fallback episode
    fallback_started: np.ndarray  # bool [B]: a fallback episode begins after this step
    step_seconds: float  # wall time of the step (host view, includes the one device sync)


@dataclass
class PrefillRecord:
    sequence_id: int
    token_ids: np.ndarray  # int64 [T]: the prompt without its last token
    entropies: np.ndarray  # float32 [T, L]
    seconds: float


StepHook = Callable[[StepRecord], None]
PrefillHook = Callable[[PrefillRecord], None]
# A sequence's own say after its prefill: its tau from what the full-depth prefill saw (None: keep it).
AfterPrefill = Callable[[PrefillRecord], float | None]


@dataclass(frozen=True, eq=False)  # eq=False: ndarray fields
class LayerCounts:
    """A finished sequence's decode steps, per layer: what its own per-request statistics need
    (the service turns them into layerwatch.request_tail.RequestLayers)."""

    tokens: int  # decode steps = generated tokens
    # int64 [L]: steps whose skip rule skipped the layer (decided; what ran is in `layers_skipped`)
    skipped: np.ndarray
    below_threshold: np.ndarray  # int64 [L]: steps whose gate score was below the sequence's threshold
    score_sum: np.ndarray  # float64 [L]: the gate scores of those steps, summed (NaN without gates)
    fallbacks: int  # fallback episodes that began in those steps


@dataclass
class SequenceUpdate:
    sequence_id: int
    new_token_ids: list[int]
    text_delta: str
    finished: bool
    finish_reason: str | None  # "stop" | "length" | "cancelled" | "error"
    layers_executed: int  # cumulative for the sequence (decode steps): layers that really ran
    layers_skipped: int  # and that did not (the depth execution's, which may differ from the rule's)
    layer_counts: LayerCounts | None = None  # on the final update only
    logprobs: list[TokenLogprob] | None = None  # of new_token_ids, when asked for
    prompt_logprobs: list[TokenLogprob | None] | None = None  # on the first update, when asked for
    error: str | None = None  # why the sequence failed (finish_reason "error"); the batch goes on
    gated_record: GatedRecord | None = None  # on the final update of a sequence submitted with record=True


@dataclass
class GenerationResult:
    token_ids: list[int]
    text: str
    finish_reason: str
    prompt_tokens: int
    completion_tokens: int
    layers_executed: int
    layers_skipped: int
    activity: np.ndarray  # bool [completion_tokens, L], True = the skip rule ran the layer (decided)
    gated_record: GatedRecord | None = None  # with record=True


@dataclass(eq=False)  # identity: a sequence is equal only to itself
class _Sequence:
    id: int
    prompt_ids: list[int]
    params: SamplingParams
    decoder: IncrementalDecoder
    generator: torch.Generator | None  # None for greedy
    slot: int = -1
    position: int = 0  # cache position the next decode step writes
    next_input: int = 0  # token the next decode step feeds
    generated: list[int] = field(default_factory=list)
    text: str = ""  # emitted text
    held: str = ""  # decoded text held back while it may be the start of a stop string
    activity: list[np.ndarray] = field(default_factory=list)
    # Running sums over its decode steps, int64 / float64 [L] (empty until it is submitted): steps
    # whose score was below its threshold, and the scores (NaN without gates). Sums, not per-step
    # rows: a row is a view that would keep its step's whole [B, L] array alive.
    below_count: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.int64))
    score_sum: np.ndarray = field(default_factory=lambda: np.zeros(0))
    fallbacks: int = 0  # fallback episodes begun in its generating steps
    request_id: str | None = None  # the caller's name for it, for log lines
    threshold: float | None = None  # the sequence's own tau; None = the policy's
    after_prefill: AfterPrefill | None = None  # may set the threshold once the prompt is prefilled
    layers_executed: int = 0
    layers_skipped: int = 0
    cancel_requested: bool = False
    finish_reason: str | None = None
    error: str | None = None
    # allowed_token_ids and one-token bad_words as one additive row [V] (0 or -inf) on the device,
    # built at its first draw: the multi-token bad_words are matched against `generated` each step.
    token_mask: torch.Tensor | None = None
    # While the prompt is scored: its log-probabilities so far (the first token's None); else None.
    scored: list[TokenLogprob | None] | None = None
    prompt_logprobs: list[TokenLogprob | None] | None = None  # once scored, until the next update carries them
    # Submitted with record=True: one `summarize_rows` row per generated token (views of the step's
    # summary, [recording rows, 34] for k = 16).
    record: list[np.ndarray] | None = None

    @property
    def recording(self) -> bool:
        """Its row of the next decode step is summarized: it records, and generates (a scoring step does not)."""
        return self.record is not None and self.scored is None


class GenerationEngine:
    def __init__(
        self,
        model: Transformer,
        tokenizer: Tokenizer,
        *,
        model_name: str,
        policy: SkipPolicyConfig,
        kv_policy: str = "project",
        max_batch_size: int = 8,
        max_seq_len: int | None = None,
        step_hook: StepHook | None = None,
        prefill_hook: PrefillHook | None = None,
        record_top_k: int = SHADOW_TOP_K,
        depth: DepthExecution | DepthExecutionConfig | None = None,
    ) -> None:
        """`depth`: how a step runs the layers its rows decided (depth_execution.py); a config gets
        this model's measured costs, None the default config."""
        if kv_policy not in KV_POLICIES:
            raise ValueError(f"kv_policy must be one of {KV_POLICIES}, got {kv_policy!r}")
        if max_batch_size < 1:
            raise ValueError(f"max_batch_size must be >= 1, got {max_batch_size}")
        config = model.config
        limit = config.max_position_embeddings
        max_seq_len = min(limit, DEFAULT_MAX_SEQ_LEN) if max_seq_len is None else max_seq_len
        if not 2 <= max_seq_len <= limit:
            raise ValueError(
                f"max_seq_len must be in 2..{limit} (the model's max_position_embeddings), got {max_seq_len}"
            )
        self.model = model.eval()
        model.lay_out_weights()  # the decode layout (model.py), if the loader did not give it
        self.tokenizer = tokenizer
        self.model_name = model_name
        self.policy_config = policy
        self.kv_policy = kv_policy
        self.max_batch_size = max_batch_size
        self.max_seq_len = max_seq_len
        self.step_hook = step_hook
        self.prefill_hook = prefill_hook
        self.record_top_k = min(record_top_k, config.vocab_size)  # tokens per position of a gated record
        self.num_layers = config.num_layers
        self.eos_token_ids = frozenset(tokenizer.eos_token_ids) | frozenset(config.eos_token_ids)
        weight = model.embed_tokens.weight
        self.device = weight.device
        self.cache = KVCache(config, max_batch_size, max_seq_len, weight.dtype, weight.device)
        self.skip_policy = SkipPolicy(policy, config.num_layers, max_batch_size)
        if not isinstance(depth, DepthExecution):
            depth = default_depth_execution(model, kv_policy, depth or DepthExecutionConfig())
        self.depth = depth
        self.steps = 0
        self._next_id = 0
        self._waiting: deque[_Sequence] = deque()
        self._active: dict[int, _Sequence] = {}  # slot -> sequence
        self._by_id: dict[int, _Sequence] = {}  # waiting and active sequences

    # --- public API ------------------------------------------------------------------------------

    def submit(
        self,
        prompt_ids: list[int],
        params: SamplingParams,
        threshold: float | None = None,
        request_id: str | None = None,
        after_prefill: AfterPrefill | None = None,
        record: bool = False,
    ) -> int:
        """Queue a sequence; it joins the batch at the next step boundary. Returns its id.
        `threshold`: the sequence's own tau in [0, 1] (0 = full depth); None = the policy's.
        `request_id`: the caller's name for the sequence's request, in the engine's log lines.
        `after_prefill`: called with the prompt's full-depth prefill (its gate scores) before the
        first decode step; a tau it returns replaces `threshold` for the generation (a scored
        prompt's log-probabilities were taken before, at `threshold`).
        `record`: keep the gated distribution's summary at each generated position (module doc)."""
        sequence = self._submit(prompt_ids, params, threshold, request_id, record)
        sequence.after_prefill = after_prefill
        return sequence.id

    def prepare_depth(self) -> None:
        """Measure the depth execution's costs now for every batch size the engine can run (mode
        "auto"), rather than in the first step at each size; logs what was found."""
        costs = self.depth.costs
        if self.depth.config.mode == "auto" and isinstance(costs, MeasuredDepthCosts):
            costs.prepare(range(2, self.max_batch_size + 1))
            log.info("depth execution %s: row-partial path up to %s", self.depth.config.describe(), costs.table())

    def cancel(self, sequence_id: int) -> None:
        """Stop a sequence at the next step boundary (unknown or finished ids are ignored)."""
        sequence = self._by_id.get(sequence_id)
        if sequence is not None:
            sequence.cancel_requested = True

    def has_work(self) -> bool:
        return bool(self._waiting or self._active)

    def running_ids(self) -> set[int]:
        """The sequences holding a batch slot (the others wait for one)."""
        return {sequence.id for sequence in self._active.values()}

    def step(self) -> list[SequenceUpdate]:
        """Apply cancellations, admit waiting sequences (prefill), run one decode step.

        What one sequence raises (its prefill, sampling, logprobs, decoding) fails that sequence
        only (finish_reason "error"); a failure of the batched model step itself raises.
        """
        updates = self._apply_cancellations()
        updates += self._admit_waiting()
        if self._active:
            updates += self._decode_step()
        return updates

    def generate(
        self, prompt_ids: list[int], params: SamplingParams, threshold: float | None = None, record: bool = False
    ) -> GenerationResult:
        """Submit one sequence and step until it finishes (other queued sequences advance too)."""
        sequence = self._submit(prompt_ids, params, threshold, record=record)
        while sequence.finish_reason is None:
            self.step()
        return GenerationResult(
            token_ids=list(sequence.generated),
            text=sequence.text,
            finish_reason=sequence.finish_reason,
            prompt_tokens=len(sequence.prompt_ids),
            completion_tokens=len(sequence.generated),
            layers_executed=sequence.layers_executed,
            layers_skipped=sequence.layers_skipped,
            activity=np.array(sequence.activity, dtype=bool).reshape(len(sequence.generated), self.num_layers),
            gated_record=self._gated_record(sequence),
        )

    # --- admission and prefill -------------------------------------------------------------------

    def _submit(
        self,
        prompt_ids: list[int],
        params: SamplingParams,
        threshold: float | None,
        request_id: str | None = None,
        record: bool = False,
    ) -> _Sequence:
        params.validate()
        if threshold is not None:
            check_threshold(threshold)
        vocab = self.model.config.vocab_size
        if not prompt_ids:
            raise ValueError("the prompt must hold at least one token")
        if not all(0 <= int(t) < vocab for t in prompt_ids):
            raise ValueError(f"prompt token ids must be in 0..{vocab - 1}")
        for name, ids in params.token_ids().items():
            if not all(0 <= t < vocab for t in ids):
                raise ValueError(f"{name} token ids must be in 0..{vocab - 1}")
        if len(prompt_ids) > self.max_seq_len:
            raise ValueError(f"prompt of {len(prompt_ids)} tokens exceeds max_seq_len={self.max_seq_len}")
        generator = None
        if params.temperature > 0:
            generator = torch.Generator(device=self.device)
            generator.manual_seed(params.seed if params.seed is not None else random.getrandbits(63))
        sequence = _Sequence(
            id=self._next_id,
            prompt_ids=[int(t) for t in prompt_ids],
            params=params,
            decoder=self.tokenizer.incremental_decoder(),
            generator=generator,
            threshold=threshold,
            request_id=request_id,
            below_count=np.zeros(self.num_layers, dtype=np.int64),
            score_sum=np.zeros(self.num_layers),
            record=[] if record else None,
        )
        self._next_id += 1
        self._waiting.append(sequence)
        self._by_id[sequence.id] = sequence
        return sequence

    def _apply_cancellations(self) -> list[SequenceUpdate]:
        cancelled = [s for s in self._by_id.values() if s.cancel_requested]
        for sequence in cancelled:
            if sequence in self._waiting:
                self._waiting.remove(sequence)
            self._finish(sequence, "cancelled")
        return [self._update(s, [], "") for s in cancelled]

    def _admit_waiting(self) -> list[SequenceUpdate]:
        """Give waiting sequences free slots: prefill them, or start scoring their prompts. A
        sequence whose prefill fails, or that generates nothing, finishes here and frees its slot."""
        updates = []
        free = sorted(set(range(self.max_batch_size)) - set(self._active))
        while self._waiting and free:
            sequence = self._next_waiting()
            if sequence is None:
                break
            sequence.slot = free[0]
            try:
                final = self._start(sequence)
            except Exception as exc:
                updates.append(self._fail(sequence, f"the model failed to run: {type(exc).__name__}: {exc}"))
                continue
            if final is not None:
                updates.append(final)
                continue
            self._active[free.pop(0)] = sequence
        return updates

    def _next_waiting(self) -> _Sequence | None:
        """Take the waiting sequence of the request that holds the fewest batch slots (the earliest
        among equals): a request of many prompts or choices takes turns with those that came after
        it, rather than every slot until its last sequence is done. Prompt scoring (echo with
        logprobs: a decode step per prompt token, 12 times a prefill's time) holds at most
        `scoring_slots`, whichever requests it serves, so that the rest stay free for whoever comes
        next; None when nothing else waits. Sequences without a request id each count as their own
        request."""
        held = Counter(s.request_id for s in self._active.values() if s.request_id is not None)
        scoring = sum(1 for s in self._active.values() if s.scored is not None)
        may_score = scoring < scoring_slots(self.max_batch_size)
        candidates = [s for s in self._waiting if may_score or not _scores_prompt(s)]
        if not candidates:
            return None
        sequence = min(candidates, key=lambda s: held[s.request_id] if s.request_id is not None else 0)
        self._waiting.remove(sequence)
        return sequence

    def _start(self, sequence: _Sequence) -> SequenceUpdate | None:
        """Score the prompt (its log-probabilities asked for, and there is a token to predict) or
        go straight to generating. -> the final update when the sequence already ended."""
        if sequence.params.prompt_logprobs is None:
            return self._begin_generation(sequence)
        if len(sequence.prompt_ids) == 1:
            sequence.prompt_logprobs = [None]  # the first token has no context to be predicted from
            return self._begin_generation(sequence)
        self._take_slot(sequence)
        sequence.scored = [None]
        sequence.position, sequence.next_input = 0, sequence.prompt_ids[0]
        return None

    def _score(self, sequence: _Sequence, logprob: TokenLogprob) -> SequenceUpdate | None:
        """A scoring step fed prompt[position]; `logprob` is prompt[position + 1]'s. The last
        prompt token is only fed once generating. -> the final update when the sequence ended."""
        assert sequence.scored is not None
        sequence.scored.append(logprob)
        sequence.position += 1
        sequence.next_input = sequence.prompt_ids[sequence.position]
        if sequence.position < len(sequence.prompt_ids) - 1:
            return None
        sequence.prompt_logprobs, sequence.scored = sequence.scored, None
        return self._begin_generation(sequence)

    def _begin_generation(self, sequence: _Sequence) -> SequenceUpdate | None:
        """The prompt is read (scored, or needs no scoring): prefill it at full depth to generate, or
        finish a sequence that generates nothing (-> its final update)."""
        if sequence.params.max_tokens == 0:
            self._finish(sequence, "length")
            return self._update(sequence, [], "")
        self._prefill(sequence)
        return None

    def _take_slot(self, sequence: _Sequence) -> None:
        """Forget what the slot held: cache and skip history (a scored prompt's too)."""
        self.cache.reset_slot(sequence.slot)
        self.skip_policy.reset(sequence.slot, sequence.threshold)

    def _prefill(self, sequence: _Sequence) -> None:
        started = time.perf_counter()
        context = sequence.prompt_ids[:-1]
        self._take_slot(sequence)
        entropies = np.full((len(context), self.num_layers), np.nan, dtype=np.float32)
        if context:
            with torch.inference_mode():
                _, prompt_entropies = self.model.prefill(
                    torch.tensor(context, device=self.device), self.cache, sequence.slot
                )
            if prompt_entropies is not None:
                entropies = prompt_entropies.float().cpu().numpy()
        sequence.position = len(context)
        sequence.next_input = sequence.prompt_ids[-1]
        if self.prefill_hook is None and sequence.after_prefill is None:
            return
        record = PrefillRecord(
            sequence_id=sequence.id,
            token_ids=np.array(context, dtype=np.int64),
            entropies=entropies,
            seconds=time.perf_counter() - started,
        )
        if self.prefill_hook is not None:
            self.prefill_hook(record)
        if sequence.after_prefill is not None:
            threshold = sequence.after_prefill(record)
            if threshold is not None:
                # No decode step has run: the slot's skip history is still empty, only tau changes.
                self.skip_policy.reset(sequence.slot, threshold)
                sequence.threshold = threshold

    # --- one decode step -------------------------------------------------------------------------

    def _decode_step(self) -> list[SequenceUpdate]:
        started = time.perf_counter()
        rows = [self._active[slot] for slot in sorted(self._active)]
        slots = np.array([s.slot for s in rows])
        fed = np.array([s.next_input for s in rows], dtype=np.int64)
        step = gated_decode_step(
            self.model,
            self.cache,
            self.skip_policy if self.model.gates is not None else None,
            torch.as_tensor(fed, device=self.device),
            slots,
            [s.position for s in rows],
            self.kv_policy,
            choose=lambda logits: self._sample(logits, rows),
            summarize=self._summarizer(rows),
            depth=self.depth,
        )
        self.steps += 1
        self._keep_records(rows, step.summary)
        for sequence in (s for s, started_now in zip(rows, step.fallback_started) if started_now):
            self._log_fallback(sequence)
        # The skip policy's own comparison, each row at its own threshold.
        below = self.skip_policy.below_threshold(slots, step.entropies)
        logprobs = self._step_logprobs(step.logits, rows, step.next_tokens)
        scoring = np.array([s.scored is not None for s in rows], dtype=bool)
        updates, ok = [], np.ones(len(rows), dtype=bool)
        for i, (sequence, token) in enumerate(zip(rows, step.next_tokens.tolist())):
            failure = sequence.error or NO_TOKEN.get(token)
            if failure is None:
                try:
                    if scoring[i]:
                        update = self._score(sequence, logprobs[i])
                    else:
                        update = self._advance(sequence, token, step, i, below[i], logprobs.get(i))
                    if update is not None:
                        updates.append(update)
                    continue
                except Exception as exc:
                    failure = f"{type(exc).__name__}: {exc}"
            ok[i] = False
            updates.append(self._fail(sequence, failure))
        # Only rows that generated a token: a failed row produced none, and a scoring row read a
        # prompt token (as prefill does), so the telemetry counts what `usage` counts.
        ok &= ~scoring
        if self.step_hook is not None and ok.any():
            self.step_hook(
                StepRecord(
                    step=self.steps,
                    sequence_ids=np.array([s.id for s in rows], dtype=np.int64)[ok],
                    token_ids=fed[ok],
                    next_token_ids=step.next_tokens[ok],
                    entropies=step.entropies[ok],
                    skipped=~step.run_mask[ok],
                    executed_skipped=~step.executed[ok],
                    # bool [L], over every row that ran; asarray: numpy types any(axis=0) as array or scalar
                    batch_skipped=np.asarray(~step.executed.any(axis=0)),
                    fallback=step.fallback[ok],
                    fallback_started=step.fallback_started[ok],
                    step_seconds=time.perf_counter() - started,
                )
            )
        return updates

    def _summarizer(self, rows: list[_Sequence]) -> Summarize | None:
        """The step's `summarize` for the rows that record (generating, not scoring), or None."""
        recording = [i for i, s in enumerate(rows) if s.recording]
        if not recording:
            return None
        index = torch.tensor(recording, device=self.device)
        k = self.record_top_k
        return lambda logits, tokens: summarize_rows(logits.index_select(0, index), tokens.index_select(0, index), k)

    @staticmethod
    def _keep_records(rows: list[_Sequence], summary: np.ndarray | None) -> None:
        """Each recording row's summary row, in `_summarizer`'s order (before `_advance` may finish it)."""
        if summary is None:
            return
        for sequence, row in zip((s for s in rows if s.recording), summary):
            assert sequence.record is not None
            sequence.record.append(row)

    def _sample(self, logits: torch.Tensor, rows: list[_Sequence]) -> torch.Tensor:
        """Next token per row, on the device: argmax, or a draw from that row's own generator,
        after the row's penalties, bias and bans. A row whose sampling raised keeps the error, a row
        with non-finite logits gets token -1, a row whose bans leave no token -2 (`NO_TOKEN`): the
        host then fails that sequence alone."""
        tokens = logits.argmax(dim=-1)
        for i, sequence in enumerate(rows):
            params = sequence.params
            # A scoring row's token is not used: it draws nothing from its generator.
            if sequence.scored is not None or (sequence.generator is None and not params.adjusts_logits()):
                continue
            try:
                row = self._adjusted_logits(logits[i], sequence)
                if sequence.generator is None:
                    token = row.argmax()
                else:
                    token = sample_token(row, params.temperature, params.top_p, sequence.generator)
                # Every token can be banned only by allowed_token_ids, or by a bad word per token of the
                # vocabulary. Checked on the device: a row banned throughout has a "most likely" token too.
                exhaustible = params.allowed_token_ids is not None or len(params.bad_words) >= row.shape[0]
                tokens[i] = torch.where(row.isfinite().any(), token, -2) if exhaustible else token
            except Exception as exc:
                sequence.error = f"sampling failed: {type(exc).__name__}: {exc}"
        # Non-finite logits have no distribution to draw from; checked on the device, so the mark
        # travels with the tokens in the step's one transfer. A row's logits times 0 sum to 0 exactly
        # when all are finite (inf * 0 and NaN are NaN): one pass, where isfinite's several passes
        # and temporaries over 49,152 logits cost 0.29 ms a step, against 0.04 (docs/performance.md).
        all_finite = (logits * 0).sum(dim=-1) == 0
        return torch.where(all_finite, tokens, -1)

    def _adjusted_logits(self, logits: torch.Tensor, sequence: _Sequence) -> torch.Tensor:
        """A row's logits [V] (float32) with its logit bias, its presence and frequency penalties, and
        -inf for the tokens it bans."""
        params = sequence.params
        adjusted = logits.float()
        if params.bans_tokens():
            if sequence.token_mask is None:
                sequence.token_mask = self._token_mask(params)
            adjusted = adjusted + sequence.token_mask
            completing = banned_now(params.bad_words, sequence.generated)
            if completing:
                adjusted = adjusted.index_fill(0, torch.tensor(completing, device=adjusted.device), float("-inf"))
        if params.logit_bias:
            ids = torch.tensor(list(params.logit_bias), device=adjusted.device)
            bias = torch.tensor(list(params.logit_bias.values()), device=adjusted.device)
            adjusted = adjusted.index_add(0, ids, bias)
        if (params.presence_penalty or params.frequency_penalty) and sequence.generated:
            counts = torch.bincount(
                torch.tensor(sequence.generated, device=adjusted.device), minlength=adjusted.shape[0]
            ).float()
            adjusted = adjusted - params.frequency_penalty * counts - params.presence_penalty * (counts > 0).float()
        return adjusted

    def _token_mask(self, params: SamplingParams) -> torch.Tensor:
        """0 for the tokens a sequence may draw at any step, -inf for the others: outside
        allowed_token_ids, or a one-token bad word."""
        vocab = self.model.config.vocab_size
        always = [word[0] for word in params.bad_words if len(word) == 1]
        mask = torch.zeros(vocab, device=self.device)
        if params.allowed_token_ids is not None:
            mask.fill_(float("-inf")).index_fill_(0, torch.tensor(params.allowed_token_ids, device=self.device), 0.0)
        if always:
            mask.index_fill_(0, torch.tensor(always, device=self.device), float("-inf"))
        return mask

    def _step_logprobs(
        self, logits: torch.Tensor, rows: list[_Sequence], tokens: np.ndarray
    ) -> dict[int, TokenLogprob]:
        """Row index -> the log-probability the row needs from this step: a scoring row's next
        prompt token's, or the generated token's when asked for (rows with finite logits only)."""
        asking, chosen, ks = [], [], []
        for i, sequence in enumerate(rows):
            if tokens[i] < 0:
                continue
            if sequence.scored is not None:
                asking.append(i)
                chosen.append(sequence.prompt_ids[sequence.position + 1])
                ks.append(sequence.params.prompt_logprobs or 0)
            elif sequence.params.logprobs is not None:
                asking.append(i)
                chosen.append(int(tokens[i]))
                ks.append(sequence.params.logprobs)
        if not asking:
            return {}
        index = torch.tensor(asking, device=logits.device)
        with torch.inference_mode():
            selected = logits.index_select(0, index)
            return dict(zip(asking, token_logprobs(selected, torch.tensor(chosen, device=logits.device), ks)))

    def _advance(
        self,
        sequence: _Sequence,
        token: int,
        step: DecodedStep,
        row: int,
        below: np.ndarray,
        logprob: TokenLogprob | None,
    ) -> SequenceUpdate:
        """Row `row` of `step` generated `token` for the sequence."""
        sequence.generated.append(token)
        sequence.activity.append(step.run_mask[row].copy())
        sequence.below_count += below
        sequence.score_sum += step.entropies[row]
        sequence.fallbacks += int(step.fallback_started[row])
        executed = int(step.executed[row].sum())  # what really ran: usage counts the work done
        sequence.layers_executed += executed
        sequence.layers_skipped += self.num_layers - executed
        sequence.position += 1
        sequence.next_input = token

        finish_reason = None
        if token in self.eos_token_ids and not sequence.params.ignore_eos:
            finish_reason = "stop"
        elif len(sequence.generated) >= sequence.params.max_tokens or sequence.position >= self.max_seq_len:
            finish_reason = "length"
        delta = sequence.decoder.push([token])
        if finish_reason is not None:
            delta += sequence.decoder.flush()
        emitted, stopped = self._apply_stop_strings(sequence, delta, final=finish_reason is not None)
        if stopped:
            finish_reason = "stop"
        if finish_reason is not None:
            self._finish(sequence, finish_reason)
        return self._update(sequence, [token], emitted, None if logprob is None else [logprob])

    @staticmethod
    def _apply_stop_strings(sequence: _Sequence, delta: str, final: bool) -> tuple[str, bool]:
        """-> (text to emit now, whether a stop string ended the sequence)."""
        stops = sequence.params.stop
        pending = sequence.held + delta
        hits = [i for i in (pending.find(s) for s in stops) if i >= 0]
        if hits:
            emitted, sequence.held = pending[: min(hits)], ""
            sequence.text += emitted
            return emitted, True
        hold = 0 if final else _longest_stop_prefix_suffix(pending, stops)
        emitted, sequence.held = pending[: len(pending) - hold], pending[len(pending) - hold :]
        sequence.text += emitted
        return emitted, False

    def _log_fallback(self, sequence: _Sequence) -> None:
        """One line per fallback episode, in the field's form (docs/alerting.md, "The field's reports"):
        the marker, then key=value pairs."""
        fields = {
            "model": self.model_name,
            "request": sequence.request_id or "-",
            "sequence": sequence.id,
            "step": self.steps,
        }
        log.warning("%s %s", FALLBACK_MARKER, " ".join(f"{key}={_logfmt(value)}" for key, value in fields.items()))

    def _fail(self, sequence: _Sequence, error: str) -> SequenceUpdate:
        """End one sequence that raised; the rest of the batch goes on."""
        log.warning("sequence %d failed: %s", sequence.id, error)
        sequence.error = error
        self._finish(sequence, "error")
        return self._update(sequence, [], "")

    def _finish(self, sequence: _Sequence, reason: str) -> None:
        sequence.finish_reason = reason
        self._by_id.pop(sequence.id, None)
        if self._active.get(sequence.slot) is sequence:
            del self._active[sequence.slot]

    def _update(
        self, sequence: _Sequence, tokens: list[int], delta: str, logprobs: list[TokenLogprob] | None = None
    ) -> SequenceUpdate:
        finished = sequence.finish_reason is not None
        prompt_logprobs, sequence.prompt_logprobs = sequence.prompt_logprobs, None  # on one update only
        return SequenceUpdate(
            sequence_id=sequence.id,
            new_token_ids=tokens,
            text_delta=delta,
            finished=finished,
            finish_reason=sequence.finish_reason,
            layers_executed=sequence.layers_executed,
            layers_skipped=sequence.layers_skipped,
            layer_counts=self._layer_counts(sequence) if finished else None,
            logprobs=logprobs,
            prompt_logprobs=prompt_logprobs,
            error=sequence.error if finished else None,
            gated_record=self._gated_record(sequence) if finished else None,
        )

    def _gated_record(self, sequence: _Sequence) -> GatedRecord | None:
        return None if sequence.record is None else GatedRecord.from_rows(sequence.record, self.record_top_k)

    def _layer_counts(self, sequence: _Sequence) -> LayerCounts:
        """When the sequence ends: its skips summed from the activity rows it keeps anyway."""
        tokens = len(sequence.activity)
        ran = np.asarray(sequence.activity, dtype=bool).reshape(tokens, self.num_layers)
        return LayerCounts(
            tokens,
            tokens - ran.sum(axis=0, dtype=np.int64),
            sequence.below_count.copy(),
            sequence.score_sum.copy(),
            sequence.fallbacks,
        )


@dataclass
class DecodedStep:
    """What one `gated_decode_step` did, per row; host arrays but for the logits."""

    logits: torch.Tensor  # [B, V] on the device
    next_tokens: np.ndarray  # int64 [B]: what `choose` picked
    entropies: np.ndarray  # float32 [B, L]: every layer's gate entropy (NaN: no gates)
    run_mask: np.ndarray  # bool [B, L]: True = the skip rule ran the layer for that row (decided)
    executed: np.ndarray  # bool [B, L]: True = the layer really ran for that row (the depth execution's)
    fallback: np.ndarray  # bool [B]: the row ran full depth because of a fallback episode
    fallback_started: np.ndarray  # bool [B]: a fallback episode begins after this step
    summary: np.ndarray | None = None  # float64 [F, W]: what `summarize` returned, when given


# (logits [B, V], next tokens [B]) -> [F, W] on the device: a per-row summary for some rows.
Summarize = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


def scoring_slots(max_batch_size: int) -> int:
    """The batch slots prompt scoring may hold at once: half (at least one); the others stay free for
    requests that score nothing (the service's admission budgets scoring by the same share)."""
    return max(1, max_batch_size // 2)


def _scores_prompt(sequence: _Sequence) -> bool:
    """Whether the sequence starts by scoring its prompt, a decode step per token (`_start`)."""
    return sequence.params.prompt_logprobs is not None and len(sequence.prompt_ids) > 1


def gated_decode_step(
    model: Transformer,
    cache: KVCache,
    policy: SkipPolicy | None,
    tokens: torch.Tensor,
    slots: np.ndarray,
    positions: list[int],
    kv_policy: str,
    choose: Callable[[torch.Tensor], torch.Tensor],
    summarize: Summarize | None = None,
    depth: DepthExecution | None = None,
) -> DecodedStep:
    """One decode step with the skip semantics: run mask from the policy -> the depth execution's
    plan -> `model.decode_step` -> the policy observes the step's entropies (which shape only later
    steps) with the mask it decided.

    tokens: [B] on the device, fed at `positions` of cache `slots` (host, [B]). policy None runs
    full depth and observes nothing (no gates attached, or full-depth evaluation). choose: logits
    [B, V] -> next tokens [B] on the device. summarize: its output rides the same one transfer.
    depth None runs every row as it decided (mode "rows").
    """
    B, L = len(slots), model.config.num_layers
    # Decided from earlier steps only, before anything runs on the device.
    fallback = policy.in_fallback(slots) if policy is not None else np.zeros(B, dtype=bool)
    run_mask = policy.run_mask(slots) if policy is not None else None
    executed = run_mask
    if depth is not None and policy is not None and run_mask is not None:
        executed = depth.plan(run_mask, policy.full_depth_rows(slots))
    with torch.inference_mode():  # cheaper per op than no_grad: a small model's step is many small ops
        logits, entropies = model.decode_step(tokens, cache, slots.tolist(), positions, executed, kv_policy)
        next_tokens = choose(logits)
        if entropies is None:
            entropies = torch.full((B, L), float("nan"), device=logits.device)
        # The step's one device->host transfer: tokens and entropies packed together (float64
        # holds token ids exactly), and the summary's rows after them.
        packed = torch.cat([next_tokens[:, None].double(), entropies.double()], dim=1)
        summary = summarize(logits, next_tokens).double() if summarize is not None else None
        flat = packed.flatten() if summary is None else torch.cat([packed.flatten(), summary.flatten()])
        host = flat.cpu().numpy()
    packed_host = host[: packed.numel()].reshape(packed.shape)
    # A copy: the recording sequences keep its rows, not the whole step's buffer.
    host_summary = None if summary is None else host[packed.numel() :].reshape(summary.shape).copy()
    host_entropies = packed_host[:, 1:].astype(np.float32)
    if policy is None or run_mask is None or executed is None:  # all None exactly when policy is
        run_mask, fallback_started = np.ones((B, L), dtype=bool), np.zeros(B, dtype=bool)
        executed = run_mask
    else:
        fallback_started = policy.observe(slots, host_entropies, run_mask).fallback_started
    return DecodedStep(
        logits=logits,
        next_tokens=packed_host[:, 0].astype(np.int64),
        entropies=host_entropies,
        run_mask=run_mask,
        executed=executed,
        fallback=fallback,
        fallback_started=fallback_started,
        summary=host_summary,
    )


def sample_token(logits: torch.Tensor, temperature: float, top_p: float, generator: torch.Generator) -> torch.Tensor:
    """One token from logits [V] at `temperature` > 0, restricted to the top-p nucleus.

    The distribution is valid for every temperature and top_p the API accepts, whatever the logits
    (a draw from an invalid one raises on the CPU and kills the context on CUDA): non-finite
    logits are clamped (the engine fails such rows anyway), the largest logit is shifted to 0 so
    that its weight exp(0) = 1 keeps the sum at least 1, the temperature is floored at float32's
    smallest normal number (1e-300 would be 0 in float32; that low, sampling is greedy but for
    exact ties), and the nucleus always keeps the most likely token.

    The nucleus is cut from the NUCLEUS_CANDIDATES most likely tokens whenever their mass reaches
    top_p, and from the whole vocabulary sorted only when it does not (one number read on the host):
    a real vocabulary's sort cost more than the rest of the draw (49,152 tokens: 9.9 ms on one CPU
    core against 0.3 ms for the top 1,024, under load; docs/performance.md, "Sampling").
    """
    logits = torch.nan_to_num(logits.float())
    probs = torch.softmax((logits - logits.max()) / max(temperature, FLOAT32_TINY), dim=-1)
    if top_p >= 1.0:
        return _draw(probs, generator)
    candidates, order = probs.topk(min(NUCLEUS_CANDIDATES, probs.numel()))
    if candidates.numel() < probs.numel() and bool(candidates.sum() < top_p):
        candidates, order = probs.sort(descending=True)
    # Keep the smallest prefix whose mass reaches top_p (the most likely token always stays).
    # (masked_fill, not boolean indexing: that would wait on the device for the mask's count.)
    outside = candidates.cumsum(-1) - candidates >= top_p
    outside[0] = False  # top_p below float32's resolution compares as 0
    return order[_draw(candidates.masked_fill(outside, 0.0), generator)]


def _draw(weights: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
    """An index into weights [N] (non-negative, a positive sum) drawn with probability proportional to
    its weight: where a uniform draw falls in their cumulative sum (float64). A weight of 0 is never
    drawn. torch.multinomial took 4.4 ms for 49,152 weights on one loaded CPU core, this 0.4 ms."""
    cumulative = weights.double().cumsum(-1)
    u = torch.rand(1, generator=generator, dtype=torch.float64, device=weights.device)
    # Searched among all but the last sum: a draw past them is the last index (u < 1 keeps it below the total).
    return torch.searchsorted(cumulative[:-1], u * cumulative[-1], right=True)[0]


def token_logprobs(logits: torch.Tensor, tokens: torch.Tensor, ks: list[int]) -> list[TokenLogprob]:
    """Per row of logits [N, V]: the log-probability of tokens[row] and the ks[row] most likely
    tokens, under the model's own distribution; brought to the host in one transfer."""
    logprobs = torch.log_softmax(logits.float(), dim=-1)
    chosen = logprobs.gather(-1, tokens[:, None])
    k = max(ks)
    top_values, top_ids = logprobs.topk(k, dim=-1) if k else (chosen[:, :0], chosen[:, :0])
    host = torch.cat([tokens[:, None].double(), chosen.double(), top_ids.double(), top_values.double()], dim=1)
    result = []
    for row, k_row in zip(host.cpu().numpy(), ks):
        top = tuple((int(row[2 + j]), float(row[2 + k + j])) for j in range(k_row))
        result.append(TokenLogprob(int(row[0]), float(row[1]), top))
    return result


def banned_now(bad_words: tuple[tuple[int, ...], ...], generated: list[int]) -> list[int]:
    """The last tokens of the multi-token bad words whose other tokens end `generated` (vLLM's rule:
    such a token would complete the word; the one-token words are in the sequence's mask)."""
    return [
        word[-1]
        for word in bad_words
        if 1 < len(word) <= len(generated) + 1 and tuple(generated[len(generated) - len(word) + 1 :]) == word[:-1]
    ]


def _logfmt(value: object) -> str:
    """A log field's value as logfmt writes it: bare when it holds no space, quote or '=', else quoted."""
    text = str(value)
    if text and not any(c.isspace() or c in '"=' for c in text):
        return text
    return json.dumps(text, ensure_ascii=False)


def _longest_stop_prefix_suffix(text: str, stops: tuple[str, ...]) -> int:
    """Length of the longest end of `text` that is the start of some stop string."""
    best = 0
    for stop in stops:
        for n in range(min(len(stop) - 1, len(text)), best, -1):
            if text.endswith(stop[:n]):
                best = n
                break
    return best
