"""Decode benchmark: batch-1 tokens/s of the gated engine on a small random model, on one CPU thread.

    .venv/bin/python benchmarks/decode_bench.py            # defaults: 12 layers, d=512, 128 tokens
    .venv/bin/python benchmarks/decode_bench.py --model DIR   # a checkpoint folder instead (e.g. SmolLM2)
    .venv/bin/python benchmarks/decode_bench.py --dtype bfloat16 --quantization int4   # as serve takes them

One run measures, on the same model and prompt, through the real GenerationEngine:
  - no gates (the plain model);
  - gates with tau = 0 (every gate computed, nothing skipped);
  - forced skip patterns of 25 % and 50 % of the layers, for both KV policies.
Forced patterns use the real policy: tau = 1 (every entropy counts as low), patience 1, and the
layers to keep marked protected, so from the second step on exactly those layers run.

Printed ratios (goals in docs/performance.md): gate overhead = tokens/s(tau = 0) / tokens/s(no gates), goal
>= 0.97; realised vs ideal speed-up, ideal = 1 / (1 - f*w) where f is the skipped fraction of
layers and w the share of a full-depth step spent in attention + FFN (what a skip removes),
measured by a per-layer profile. The gates are random (a gate costs the same whatever its weights;
the forced patterns do not read their scores), also with `--model`.
Results go into docs/performance.md ("Decode").
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import cast

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tokenizers import Tokenizer as BackendTokenizer
from tokenizers import models

from layerwatch.inference_shim.runtime.checkpoint import DTYPES, CheckpointError, load_checkpoint
from layerwatch.inference_shim.runtime.engine import GenerationEngine, SamplingParams, StepRecord
from layerwatch.inference_shim.runtime.model import KV_POLICIES, Block, GateBank, ModelConfig, Transformer
from layerwatch.inference_shim.runtime.quantization import PrecisionError, check_precision, quantize_model
from layerwatch.inference_shim.runtime.tokenizer import Tokenizer
from layerwatch.inference_shim.service.settings import PRECISION_SETTINGS, ModelSettings
from layerwatch.settings import add_flags
from layerwatch.skip_policy import SkipPolicyConfig

HEAD_DIM = 64


def build_model(
    layers: int, hidden: int, vocab: int, dtype: str = "float32", quantization: str = "none"
) -> Transformer:
    """A random Llama-shaped model: heads of HEAD_DIM, one KV head per four query heads; in `dtype`
    (a DTYPES name) and `quantization`, as `serve --dtype --quantization` loads a checkpoint."""
    if hidden < HEAD_DIM or hidden % HEAD_DIM:
        # Else its heads would not cover d (at d < 64: none at all, and the model computes nothing).
        raise ValueError(f"d = {hidden}: a random benchmark model needs a positive multiple of {HEAD_DIM}")
    config = ModelConfig(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=hidden * 11 // 4,
        num_layers=layers,
        num_heads=hidden // HEAD_DIM,
        num_kv_heads=max(1, hidden // 256),
        head_dim=HEAD_DIM,
        max_position_embeddings=4096,
    )
    torch.manual_seed(0)
    model = Transformer(config).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0.0, 0.02)
    model.lay_out_weights()  # as a loaded checkpoint is, and as the engine decodes
    return quantize_model(model.to(DTYPES[dtype]), quantization)


def bench_tokenizer(vocab: int) -> Tokenizer:
    # Ids only: a word-level vocabulary of numbered tokens (decoding cost is part of the step).
    return Tokenizer(BackendTokenizer(models.WordLevel({f"t{i}": i for i in range(vocab)}, unk_token="t0")))


def forced_policy(num_layers: int, fraction: float) -> SkipPolicyConfig:
    """Skip round(fraction * L) layers spread over the middle; the rest are protected (always run)."""
    skipped = round(fraction * num_layers)
    candidates = np.arange(1, num_layers - 1)
    picks = set(candidates[np.linspace(0, len(candidates) - 1, skipped).round().astype(int)].tolist())
    protected = tuple(l for l in range(num_layers) if l not in picks)
    return SkipPolicyConfig(threshold=1.0, patience=1, protected_layers=protected)


def decode_steps(
    model: Transformer, tokenizer: Tokenizer, policy: SkipPolicyConfig, kv_policy: str, prompt: list[int], tokens: int
) -> tuple[list[float], list[float], float]:
    """-> (wall seconds and CPU seconds of each decode step after the first, mean layers run per token).

    The first step is left out: it holds the prefill and runs full depth (patience).
    """
    records: list[StepRecord] = []
    engine = GenerationEngine(
        model,
        tokenizer,
        model_name="bench",
        policy=policy,
        kv_policy=kv_policy,
        max_batch_size=1,
        max_seq_len=len(prompt) + tokens + 1,
        step_hook=records.append,
    )
    engine.submit(prompt, SamplingParams(max_tokens=tokens, ignore_eos=True))
    cpu: list[float] = []
    while engine.has_work():
        started = time.thread_time()
        engine.step()
        cpu.append(time.thread_time() - started)
    steady = records[1:]
    return [r.step_seconds for r in steady], cpu[1:], float(np.mean([(~r.skipped).sum() for r in steady]))


@contextmanager
def skippable_spans(model: Transformer, clock: Callable[[], float]) -> Iterator[tuple[list[float], list[float]]]:
    """(starts, ends): clock readings where each layer's skippable part starts and ends, appended as
    layers run, while the block is active.

    A layer's skippable part starts at its q/k/v projection (decode_qkv, after the input norm and
    the gate, which always run; a step where every row runs the layer calls it) and ends where the
    next layer's input norm (or the final norm) starts. Prefill projects through another path, so
    only decode steps start a span; they end one too, and so does every prefill layer.
    """
    starts: list[float] = []
    ends: list[float] = []
    blocks = list(cast("Iterable[Block]", model.layers))  # nn.ModuleList is not generic

    def timed(projection: Callable) -> Callable:
        def project(*args):
            starts.append(clock())
            return projection(*args)

        return project

    projections = [block.self_attn.decode_qkv for block in blocks]
    for block, projection in zip(blocks, projections):
        block.self_attn.decode_qkv = timed(projection)
    handles = [block.input_layernorm.register_forward_pre_hook(lambda *_: ends.append(clock())) for block in blocks[1:]]
    handles.append(model.norm.register_forward_pre_hook(lambda *_: ends.append(clock())))
    try:
        yield starts, ends
    finally:
        for handle in handles:
            handle.remove()
        for block, projection in zip(blocks, projections):
            block.self_attn.decode_qkv = projection


def skippable_share(model: Transformer, tokenizer: Tokenizer, prompt: list[int], tokens: int) -> float:
    """w: the share of a full-depth decode step spent in what skipping removes (attention + FFN),
    measured per step by `skippable_spans`. Execution is synchronous on one CPU thread, so the
    thread's CPU clock measures the work.
    """
    clock = time.thread_time
    L = len(model.layers)
    engine = GenerationEngine(
        model,
        tokenizer,
        model_name="bench",
        policy=SkipPolicyConfig(threshold=0.0),
        max_batch_size=1,
        max_seq_len=len(prompt) + tokens + 1,
    )
    engine.submit(prompt, SamplingParams(max_tokens=tokens, ignore_eos=True))
    shares: list[float] = []
    with skippable_spans(model, clock) as (starts, ends):
        while engine.has_work():
            started = clock()
            engine.step()
            shares.append(sum(e - s for s, e in zip(starts[-L:], ends[-L:])) / (clock() - started))
    return statistics.median(shares[1:])


def main() -> int:
    parser = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--vocab", type=int, default=8192)
    parser.add_argument("--tokens", type=int, default=128, help="decode steps per measurement")
    parser.add_argument("--repeats", type=int, default=5, help="generations per configuration, interleaved")
    parser.add_argument("--model", type=Path, help="a checkpoint folder instead of the random model")
    add_flags(parser, ModelSettings, PRECISION_SETTINGS)
    args = parser.parse_args()
    try:
        check_precision(torch.device("cpu"), DTYPES[args.dtype], args.quantization)
    except PrecisionError as exc:
        parser.error(str(exc))
    torch.set_num_threads(1)  # one thread: the thread's CPU clock then measures all of a step's work

    if args.model is not None:
        try:
            loaded = load_checkpoint(args.model, dtype=DTYPES[args.dtype], quantization=args.quantization)
        except (CheckpointError, PrecisionError) as exc:
            parser.error(str(exc))
        model, tokenizer = loaded.model, loaded.tokenizer
        config = model.config
        args.layers, args.hidden, args.vocab = config.num_layers, config.hidden_size, config.vocab_size
    else:
        model = build_model(args.layers, args.hidden, args.vocab, args.dtype, args.quantization)
        tokenizer = bench_tokenizer(args.vocab)
    if args.layers < 4:  # the forced patterns skip up to half the layers, never the first or the last
        parser.error(f"--layers {args.layers}: at least 4 (the forced patterns skip half the inner layers)")
    torch.manual_seed(1)
    gates = GateBank(args.layers, args.hidden).eval().to(DTYPES[args.dtype])
    prompt = list(range(1, 17))
    L = args.layers

    configs = [
        ("no gates", None, SkipPolicyConfig(threshold=0.0), "project"),
        ("gates, tau=0", gates, SkipPolicyConfig(threshold=0.0), "project"),
    ]
    for fraction in (0.25, 0.5):
        for kv_policy in KV_POLICIES:
            configs.append((f"skip {fraction:.0%} ({kv_policy})", gates, forced_policy(L, fraction), kv_policy))

    wall: dict[str, list[float]] = {name: [] for name, *_ in configs}
    cpu: dict[str, list[float]] = {name: [] for name, *_ in configs}
    depth: dict[str, float] = {}
    for _ in range(args.repeats):  # interleaved, so drifting machine load hits every configuration alike
        for name, bank, policy, kv_policy in configs:
            model.attach_gates(bank)
            step_wall, step_cpu, depth[name] = decode_steps(model, tokenizer, policy, kv_policy, prompt, args.tokens)
            wall[name] += step_wall
            cpu[name] += step_cpu
    model.attach_gates(gates)
    w = skippable_share(model, tokenizer, prompt, args.tokens)
    # tokens/s from the median step time, robust to a few preempted steps. Ratios use the CPU
    # clock: on a shared machine, wall time also measures the neighbours.
    wall_rate = {name: 1.0 / statistics.median(values) for name, values in wall.items()}
    cpu_rate = {name: 1.0 / statistics.median(values) for name, values in cpu.items()}

    weights = "" if args.quantization == "none" else f", {args.quantization} weights"
    print(
        f"model: {L} layers, d={args.hidden}, {args.dtype}{weights}, vocab {args.vocab}; "
        f"batch 1, {args.repeats} x {args.tokens} decode steps, median step time, one torch thread"
    )
    print(f"w (share of a full-depth step in attention + FFN, per-layer profile) = {w:.3f}")
    print()
    header = f"{'configuration':<24} {'tokens/s':>9} {'tokens/cpu-s':>12} {'layers run':>10}"
    print(header + f" {'speed-up':>9} {'ideal':>7} {'realised/ideal':>15}")
    base = cpu_rate["gates, tau=0"]
    for name, *_ in configs:
        line = f"{name:<24} {wall_rate[name]:>9.1f} {cpu_rate[name]:>12.1f} {depth[name]:>10.2f}"
        if name.startswith("skip"):
            f = 1 - depth[name] / L
            speedup, ideal = cpu_rate[name] / base, 1 / (1 - f * w)
            line += f" {speedup:>9.3f} {ideal:>7.3f} {speedup / ideal:>15.3f}"
        print(line)
    print()
    print(
        f"gate overhead: tokens/s(gates, tau=0) / tokens/s(no gates) = {base / cpu_rate['no gates']:.3f} "
        f"(goal >= 0.97; wall clock: {wall_rate['gates, tau=0'] / wall_rate['no gates']:.3f})"
    )
    print("speed-up: against gates with tau=0, CPU clock; realised/ideal goal >= 0.90")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
