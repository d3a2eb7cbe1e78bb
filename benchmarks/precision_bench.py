"""Each precision of one checkpoint, its speed next to its quality: `--dtype` and `--quantization` as serve takes them.

    .venv/bin/python benchmarks/precision_bench.py --model DIR [--gates FILE] --data A.txt,B.txt
        [--precisions float32,bfloat16,float32+int8,float32+int4,bfloat16+int4] [--tokens 128] [--repeats 3]

Per precision (DTYPE or DTYPE+QUANTIZATION), loaded as `serve --dtype DTYPE --quantization QUANTIZATION` loads it:
  - tokens per CPU second at batch 1 on one torch thread: greedy generation of `--tokens` tokens
    through the real GenerationEngine from the same prompt, at full depth (no gates) and, with
    `--gates`, gated at the gate file's own τ; every precision interleaved `--repeats` times, each
    repetition's ratio to float32's full depth paired, the median printed (range in brackets);
  - the weights a decode step reads (MB): what bounds its speed, over the memory bandwidth;
  - full-depth perplexity on each `--data` text, as `eval --no-gates` measures it (teacher-forced
    windows of 128 tokens after a prefill of 16, `--max-tokens` predictions, batch 8), and its change
    against the first precision's.
Printed: a Markdown table (docs/performance.md, "Weights in low precision").
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Iterable
from pathlib import Path

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from layerwatch.inference_shim.offline.evaluation import full_depth_result, full_depth_runs, heldout_windows
from layerwatch.inference_shim.offline.training import text_file_stream
from layerwatch.inference_shim.runtime.checkpoint import DTYPES, CheckpointError, LoadedCheckpoint, load_precise
from layerwatch.inference_shim.runtime.engine import GenerationEngine, SamplingParams
from layerwatch.inference_shim.runtime.gates import LoadedGates, load_gates
from layerwatch.inference_shim.runtime.quantization import QUANTIZATIONS, PrecisionError
from layerwatch.skip_policy import SkipPolicyConfig

PROMPT = "The history of the printing press begins"
WINDOW, PREFILL = 128, 16


def tokens_per_cpu_second(loaded: LoadedCheckpoint, gates: LoadedGates | None, tokens: int) -> float:
    model = loaded.model
    model.attach_gates(None if gates is None else gates.gates)
    policy = SkipPolicyConfig(threshold=0.0) if gates is None else gates.metadata.policy()
    prompt = loaded.tokenizer.encode(PROMPT)
    engine = GenerationEngine(
        model,
        loaded.tokenizer,
        model_name="bench",
        policy=policy,
        max_batch_size=1,
        max_seq_len=len(prompt) + tokens + 1,
    )
    started = time.process_time()
    engine.generate(prompt, SamplingParams(max_tokens=tokens, temperature=0.0, ignore_eos=True))
    return tokens / (time.process_time() - started)


def perplexity(loaded: LoadedCheckpoint, text: Path, max_tokens: int) -> float:
    stream = text_file_stream(loaded.tokenizer, text, min_tokens=WINDOW)
    windows = heldout_windows(stream, WINDOW, max_tokens, PREFILL)
    runs = full_depth_runs(loaded.model, windows, prefill=PREFILL, kv_policy="project", batch_size=8, repeats=1)
    return full_depth_result(runs)["perplexity_full"]


def weight_bytes(parts: Iterable[nn.Module]) -> int:
    """The bytes of the modules' parameters and buffers."""
    tensors = [t for part in parts for t in (*part.parameters(), *part.buffers())]
    return sum(t.numel() * t.element_size() for t in tensors)


def weight_megabytes_per_token(loaded: LoadedCheckpoint) -> float:
    """The weights one decode step reads: every layer's, the final norm's and the LM head's (a tied
    float head is the embedding table; of the table itself a lookup reads one row)."""
    model = loaded.model
    return weight_bytes([*model.layers, model.norm, model.lm_head]) / 1e6


def spread(values: list[float]) -> str:
    return f"{statistics.median(values):.2f} ({min(values):.2f}–{max(values):.2f})"


def main() -> int:
    parser = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.splitlines()[0])
    parser.add_argument("--model", type=Path, required=True, help="checkpoint folder")
    parser.add_argument("--gates", type=Path, help="gate file: adds gated ÷ full at its τ")
    parser.add_argument("--data", required=True, help="comma-separated held-out texts")
    parser.add_argument("--precisions", default="float32,bfloat16,float32+int8,float32+int4,bfloat16+int4")
    parser.add_argument("--tokens", type=int, default=128, help="generated tokens per speed measurement")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--max-tokens", type=int, default=2048, help="predicted tokens per perplexity text")
    args = parser.parse_args()
    torch.set_num_threads(1)
    texts = [Path(p) for p in args.data.split(",")]
    precisions = args.precisions.split(",")
    models: dict[str, LoadedCheckpoint] = {}
    gates: dict[str, LoadedGates] = {}
    for precision in precisions:
        dtype, _, quantization = precision.partition("+")
        if dtype not in DTYPES or (quantization or "none") not in QUANTIZATIONS:
            parser.error(
                f"--precisions: {precision!r} is not DTYPE or DTYPE+QUANTIZATION "
                f"(DTYPE one of {', '.join(DTYPES)}; QUANTIZATION one of {', '.join(QUANTIZATIONS)})"
            )
        try:
            models[precision] = load_precise(args.model, "cpu", dtype, quantization or "none")
        except (CheckpointError, PrecisionError) as exc:
            parser.error(str(exc))
        if args.gates is not None:
            gates[precision] = load_gates(args.gates, models[precision].model)

    full: dict[str, list[float]] = {p: [] for p in precisions}
    gated: dict[str, list[float]] = {p: [] for p in precisions}
    for _ in range(args.repeats):  # interleaved: a drifting machine load hits every precision alike
        for precision in precisions:
            full[precision].append(tokens_per_cpu_second(models[precision], None, args.tokens))
            if args.gates is not None:
                gated[precision].append(tokens_per_cpu_second(models[precision], gates[precision], args.tokens))
    quality = {p: [perplexity(models[p], text, args.max_tokens) for text in texts] for p in precisions}

    base = precisions[0]
    print(
        f"{args.model.name}: batch 1, one torch thread, {args.tokens} greedy tokens, {args.repeats} interleaved "
        f"repeats (median, range); perplexity over {args.max_tokens} predicted tokens per text, full depth"
    )
    header = "| precision | weights read per token (MB) | tokens/CPU-s | ÷ " + base + " |"
    rule = "|---|---:|---:|---:|"
    if args.gates is not None:
        tau = next(iter(gates.values())).metadata.threshold
        header += f" gated ÷ full (τ {tau:g}) |"
        rule += "---:|"
    for text in texts:
        header += f" perplexity {text.name} |"
        rule += "---:|"
    print(header)
    print(rule)
    for precision in precisions:
        ratios = [ours / theirs for ours, theirs in zip(full[precision], full[base])]
        megabytes = weight_megabytes_per_token(models[precision])
        row = f"| {precision} | {megabytes:.0f} | {statistics.median(full[precision]):.1f} | {spread(ratios)} |"
        if args.gates is not None:
            row += f" {spread([g / f for g, f in zip(gated[precision], full[precision])])} |"
        for index in range(len(texts)):
            value, reference = quality[precision][index], quality[base][index]
            row += f" {value:.3f} ({value / reference - 1:+.2%}) |"
        print(row)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
