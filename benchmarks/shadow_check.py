"""The shadow check on a model: what it costs per request and on the decode path, and what it estimates.

    .venv/bin/python benchmarks/shadow_check.py                      # the demo model, held-out text needed
    .venv/bin/python benchmarks/shadow_check.py --data runs/demo/heldout.txt --requests 64

1. Cost per request. Sampled completions of the load generator's prompts (layerwatch/demo/loadgen.py, temperature
   1.0 and 0.7 in turn), each decoded alone by the real GenerationEngine with its gated distribution
   recorded, then checked as the shim checks it (`full_depth_agreement`, with and without the layer
   probe). Prints the median of shadow-job seconds / the request's decode seconds: while requests
   decode, shadow work may take 10 % of the engine thread (layerwatch/inference_shim/service/shadow.py), so a busy
   shim can check about 0.1 / ratio of its requests.
2. Decode-path cost of recording: decode tokens per CPU second of `--batch` sequences with every row
   recording vs none, in interleaved repetitions (the median and spread of the paired ratios), and
   the recording ops' own time per step against the step's (steadier on a shared machine).
3. What it estimates. On the same sampled requests: agreement, KL(gated || full) per token with the
   record's K = 16 and exactly (K = the vocabulary), the sample-based estimate (meaningful at
   temperature 1 only), and the perplexity estimate exp(mean KL(full || gated)) - 1. On held-out text
   (`--data`, windows of `--window` tokens after a `--prefill`-token prefill, as `layerwatch eval`
   cuts them): eval's perplexity increase on the text's own next tokens, and the shadow estimate on the
   same contexts, which separates what the contexts change from what the estimator does
   (docs/service.md, "Quality guard").
"""

from __future__ import annotations

import argparse
import logging
import math
import statistics
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from layerwatch.demo.loadgen import PROMPTS, TEMPERATURES
from layerwatch.inference_shim.offline.corpus import read_documents
from layerwatch.inference_shim.runtime import engine as engine_module
from layerwatch.inference_shim.runtime.agreement import (
    SHADOW_TOP_K,
    GatedRecord,
    ShadowJob,
    ShadowResult,
    full_depth_agreement,
    summarize_rows,
)
from layerwatch.inference_shim.runtime.checkpoint import LoadedCheckpoint, load_checkpoint
from layerwatch.inference_shim.runtime.demo_model import DEMO_MODEL_DIR
from layerwatch.inference_shim.runtime.engine import GenerationEngine, SamplingParams, gated_decode_step
from layerwatch.inference_shim.runtime.gates import GATES_FILE, load_gates
from layerwatch.inference_shim.runtime.model import KVCache
from layerwatch.inference_shim.runtime.skip_policy import SkipPolicy
from layerwatch.skip_policy import SkipPolicyConfig


@dataclass
class Totals:
    """ShadowResult fields summed over checks."""

    tokens: int = 0
    agreements: int = 0
    kl: float = 0.0
    reverse: float = 0.0
    log_ratio: float = 0.0

    def add(self, r: ShadowResult) -> None:
        self.tokens += r.tokens
        self.agreements += r.agreements
        self.kl += r.kl_nats
        self.reverse += r.reverse_kl_nats
        self.log_ratio += r.sampled_log_ratio

    def per_token(self, name: str) -> float:
        return getattr(self, name) / max(self.tokens, 1)


@dataclass
class Estimates:
    coarse: Totals = field(default_factory=Totals)  # K = SHADOW_TOP_K, as the shim records
    exact: Totals = field(default_factory=Totals)  # K = V


def sampled_requests(loaded: LoadedCheckpoint, policy: SkipPolicyConfig, args) -> tuple[list[float], Estimates]:
    """Sections 1 and 3 on generated text: shadow seconds / decode seconds per request, and the estimates."""
    model, tokenizer = loaded.model, loaded.tokenizer
    vocab = model.config.vocab_size
    engines = {
        k: GenerationEngine(model, tokenizer, model_name="bench", policy=policy, record_top_k=k)
        for k in (SHADOW_TOP_K, vocab)
    }
    ratios, probe_ms, plain_ms, decode_ms = [], [], [], []
    estimates = Estimates()
    for i in range(args.requests):
        prompt = tokenizer.encode(PROMPTS[i % len(PROMPTS)])
        params = SamplingParams(max_tokens=args.tokens, temperature=TEMPERATURES[i % len(TEMPERATURES)], seed=i)
        started = time.perf_counter()
        result = engines[SHADOW_TOP_K].generate(prompt, params, record=True)
        decode = time.perf_counter() - started
        assert result.gated_record is not None  # record=True
        job = ShadowJob(prompt, result.token_ids, result.gated_record)
        started = time.perf_counter()
        checked = full_depth_agreement(model, job, layer_signals=True)  # what the shim runs
        probed = time.perf_counter() - started
        started = time.perf_counter()
        full_depth_agreement(model, job)
        plain_ms.append(1e3 * (time.perf_counter() - started))
        ratios.append(probed / decode)
        probe_ms.append(1e3 * probed)
        decode_ms.append(1e3 * decode)
        estimates.coarse.add(checked)
        exact = engines[vocab].generate(prompt, params, record=True)
        assert exact.token_ids == result.token_ids and exact.gated_record is not None  # recording changes no token
        estimates.exact.add(full_depth_agreement(model, ShadowJob(prompt, exact.token_ids, exact.gated_record)))
    print(
        f"\n1. cost per request ({args.requests} requests of {args.tokens} tokens, temperatures {TEMPERATURES}, "
        "batch 1):"
        f"\n   decode {statistics.median(decode_ms):.1f} ms, shadow job {statistics.median(probe_ms):.1f} ms with the "
        f"layer probe ({statistics.median(plain_ms):.1f} ms without), median"
        f"\n   shadow job / decode: median {statistics.median(ratios):.3f} (range {min(ratios):.3f}-{max(ratios):.3f})"
        f" -> a busy engine (duty cycle 0.1) checks about {min(1.0, 0.1 / statistics.median(ratios)):.0%} of its "
        "requests"
    )
    return ratios, estimates


def recording_cost(loaded: LoadedCheckpoint, policy: SkipPolicyConfig, args) -> None:
    """Section 2: paired decode runs of a batch, every row recording vs none; and, as on a busy machine
    the steadier measure, the recording ops' own time inside each step against the step's."""
    prompt = loaded.tokenizer.encode(PROMPTS[0])
    summary_seconds: list[float] = []
    step_seconds: list[float] = []

    def timed_summary(logits: torch.Tensor, emitted: torch.Tensor, k: int) -> torch.Tensor:
        started = time.perf_counter()
        summary = summarize_rows(logits, emitted, k)
        summary_seconds.append(time.perf_counter() - started)  # CPU: the ops ran synchronously
        return summary

    def run(record: bool) -> float:
        engine = GenerationEngine(
            loaded.model,
            loaded.tokenizer,
            model_name="bench",
            policy=policy,
            max_batch_size=args.batch,
            step_hook=(lambda step: step_seconds.append(step.step_seconds)) if record else None,
        )
        for i in range(args.batch):
            engine.submit(prompt, SamplingParams(max_tokens=args.tokens, temperature=1.0, seed=i), record=record)
        engine.step()  # prefill and the first step stay outside the timed part
        started, steps = time.process_time(), 0
        while engine.has_work():
            engine.step()
            steps += 1
        return steps * args.batch / (time.process_time() - started)

    run(False)  # warm-up
    paired = []
    # The engine calls the module's summarize_rows: timed in place, the same ops on the same step.
    engine_module.summarize_rows = timed_summary
    try:
        for repetition in range(args.repetitions):
            order = (False, True) if repetition % 2 == 0 else (True, False)
            rates = {record: run(record) for record in order}
            paired.append(rates[True] / rates[False])
    finally:
        engine_module.summarize_rows = summarize_rows
    summary, step = statistics.median(summary_seconds), statistics.median(step_seconds)
    print(
        f"\n2. decode path, batch {args.batch}, {args.tokens} tokens, {args.repetitions} interleaved repetitions: "
        f"tokens per CPU second, every row recording / none: median {statistics.median(paired):.4f} "
        f"(range {min(paired):.4f}-{max(paired):.4f})"
        f"\n   the recording ops: {summary * 1e6:.0f} us per step of {step * 1e3:.2f} ms (medians) -> ratio "
        f"{1 - summary / step:.4f}"
    )


def heldout(loaded: LoadedCheckpoint, policy_config: SkipPolicyConfig, args) -> tuple[Estimates, int]:
    """Section 3 on held-out text: the text's windows teacher-forced through the gated decode step (as
    `layerwatch eval` feeds them), each position's gated distribution recorded as the engine records a
    generated one (the text's next token as the emitted one), then checked like a shadow job."""
    model, tokenizer = loaded.model, loaded.tokenizer
    text = "\n\n".join(read_documents(args.data))
    stream = torch.tensor(tokenizer.encode(text), dtype=torch.long)
    count = min(args.windows, len(stream) // args.window)
    windows = stream[: count * args.window].view(count, args.window)
    estimates = Estimates()
    context = args.prefill - 1
    for start in range(0, count, 8):
        batch = windows[start : start + 8]
        for k, totals in ((SHADOW_TOP_K, estimates.coarse), (model.config.vocab_size, estimates.exact)):
            for row, record in enumerate(_teacher_forced_records(model, batch, context, policy_config, k)):
                tokens = batch[row].tolist()
                totals.add(full_depth_agreement(model, ShadowJob(tokens[: context + 1], tokens[context + 1 :], record)))
    return estimates, count


def _teacher_forced_records(model, batch: torch.Tensor, context: int, policy_config, k: int) -> list[GatedRecord]:
    rows, window = batch.shape
    weight = model.embed_tokens.weight
    cache = KVCache(model.config, slots=rows, max_len=window, dtype=weight.dtype, device=weight.device)
    with torch.inference_mode():
        for slot in range(rows):
            model.prefill(batch[slot, :context], cache, slot)
    slots = np.arange(rows)
    policy = SkipPolicy(policy_config, model.config.num_layers, rows)
    kept: list[list[np.ndarray]] = [[] for _ in range(rows)]
    for position in range(context, window - 1):
        following = batch[:, position + 1]  # the "emitted" token: the text's own next one

        def summarize(logits: torch.Tensor, _: torch.Tensor, following: torch.Tensor = following) -> torch.Tensor:
            return summarize_rows(logits, following, k)

        step = gated_decode_step(
            model,
            cache,
            policy,
            batch[:, position],
            slots,
            [position] * rows,
            "project",
            choose=lambda logits: logits.argmax(dim=-1),
            summarize=summarize,
        )
        assert step.summary is not None
        for row in range(rows):
            kept[row].append(step.summary[row])
    return [GatedRecord.from_rows(rows_kept, k) for rows_kept in kept]


def report(where: str, e: Estimates) -> None:
    c, x = e.coarse, e.exact
    print(
        f"   {where}: {c.tokens} tokens, agreement {c.per_token('agreements'):.3f}; KL(gated || full) per token "
        f"{c.per_token('kl'):.4f} (K = {SHADOW_TOP_K}) / {x.per_token('kl'):.4f} (exact); perplexity estimate "
        f"exp(KL(full || gated)) - 1: {math.expm1(c.per_token('reverse')):+.2%} (K = {SHADOW_TOP_K}) / "
        f"{math.expm1(x.per_token('reverse')):+.2%} (exact); sample-based mean log p_gated(y) - log p_full(y) "
        f"{c.per_token('log_ratio'):.4f}, and exp(-that) - 1 = {math.expm1(-c.per_token('log_ratio')):+.2%}"
    )


def main() -> int:
    parser = argparse.ArgumentParser(
        allow_abbrev=False, description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", type=Path, default=DEMO_MODEL_DIR, help="checkpoint folder with its gate file")
    parser.add_argument("--data", type=Path, default=None, help="held-out text for section 3 (skipped without)")
    parser.add_argument("--requests", type=int, default=48, help="sampled requests (sections 1 and 3)")
    parser.add_argument("--tokens", type=int, default=32, help="tokens per request")
    parser.add_argument("--batch", type=int, default=4, help="section 2: concurrent sequences")
    parser.add_argument("--repetitions", type=int, default=9, help="section 2: interleaved repetitions")
    parser.add_argument("--windows", type=int, default=64, help="section 3: held-out windows")
    parser.add_argument("--window", type=int, default=128, help="section 3: tokens per window (eval's default)")
    parser.add_argument("--prefill", type=int, default=16, help="section 3: full-depth prefill (eval's default)")
    parser.add_argument("--threads", type=int, default=1, help="torch threads")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    logging.disable(logging.WARNING)  # the engine's fallback lines
    loaded = load_checkpoint(args.model)
    gates = load_gates(args.model / GATES_FILE, loaded.model)
    loaded.model.attach_gates(gates.gates)
    policy = gates.metadata.policy()
    print(f"{args.model.name}: gates {gates.sha256[:12]}, threshold {policy.threshold:g}, torch threads {args.threads}")
    _, sampled = sampled_requests(loaded, policy, args)
    recording_cost(loaded, policy, args)
    print("\n3. what the shadow check estimates:")
    report(f"sampled requests (temperatures {TEMPERATURES})", sampled)
    if args.data is not None:
        estimates, count = heldout(loaded, policy, args)
        report(f"held-out text ({count} windows of {args.window}, prefill {args.prefill})", estimates)
        print(
            "   (on held-out text the sample-based line is layerwatch eval's: the text's own next tokens, "
            "exp(-mean log ratio) - 1 its perplexity increase)"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
