"""Service benchmark: decode tokens/s with the shim's telemetry on vs off, in one run.

    .venv/bin/python benchmarks/service_bench.py                  # the demo model if trained, else random
    .venv/bin/python benchmarks/service_bench.py --model DIR      # any checkpoint folder (gates optional)
    .venv/bin/python benchmarks/service_bench.py --random         # a random model (--layers, --hidden)
    .venv/bin/python benchmarks/service_bench.py --model DIR --quantization int4   # as serve loads it (--dtype too)

"On" is exactly what `layerwatch serve` hangs on the engine's step hook: the per-layer metric
accumulation (DecodeStats) and one gate frame per step over UDP to an exporter stand-in (a separate
process that receives and discards the datagrams); the trace file is off. "Off" is the same
engine without a hook. With `--shadow-rate R`, "on" also records the gated distribution of that share of
its sequences, as the shim does for the requests its shadow check samples (docs/service.md, "Quality
guard"): the decode path's whole cost of telemetry plus shadow sampling. Both drive the real
GenerationEngine with `--batch` concurrent sequences,
in interleaved repetitions (alternating which goes first) so that machine noise hits both alike.
Prints tokens/s for each and the ratio on/off (goal >= 0.99): the median over repetitions of the
ratio of the two adjacent runs, and the ratio of the best runs, in wall time and in tokens per CPU
second of the process (preemption by other processes does not count), plus the hook's own cost
per step, timed inside the engine. Results: docs/performance.md, "Service".
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.decode_bench import bench_tokenizer, build_model
from layerwatch.client import GateFrameSender
from layerwatch.inference_shim.runtime.checkpoint import DTYPES
from layerwatch.inference_shim.runtime.demo_model import DEMO_MODEL_DIR, demo_model_present
from layerwatch.inference_shim.runtime.engine import GenerationEngine, SamplingParams, StepHook, StepRecord
from layerwatch.inference_shim.runtime.gates import gates_path_for
from layerwatch.inference_shim.runtime.model import GateBank, Transformer
from layerwatch.inference_shim.runtime.quantization import PrecisionError, check_precision
from layerwatch.inference_shim.runtime.tokenizer import Tokenizer
from layerwatch.inference_shim.service.metrics import DecodeStats
from layerwatch.inference_shim.service.settings import PRECISION_SETTINGS, ModelSettings
from layerwatch.inference_shim.service.telemetry import StepTelemetry
from layerwatch.settings import add_flags
from layerwatch.skip_policy import SkipPolicyConfig

# The exporter stand-in: binds a loopback UDP port, prints it, discards what arrives.
RECEIVER = (
    "import socket,sys\ns=socket.socket(socket.AF_INET,socket.SOCK_DGRAM)\ns.bind(('127.0.0.1',0))\n"
    "print(s.getsockname()[1],flush=True)\nwhile True: s.recv(65536)\n"
)


def random_model(
    layers: int, hidden: int, vocab: int, dtype: str = "float32", quantization: str = "none"
) -> tuple[Transformer, Tokenizer]:
    model = build_model(layers, hidden, vocab, dtype, quantization)
    model.attach_gates(GateBank(layers, hidden).eval().to(DTYPES[dtype]))
    return model, bench_tokenizer(vocab)


def load_model(folder: Path, dtype: str = "float32", quantization: str = "none") -> tuple[Transformer, Tokenizer]:
    from layerwatch.inference_shim.runtime.checkpoint import load_checkpoint
    from layerwatch.inference_shim.runtime.gates import load_gates

    loaded = load_checkpoint(folder, dtype=DTYPES[dtype], quantization=quantization)
    gates_path = gates_path_for(folder)
    gates = (
        load_gates(gates_path, loaded.model).gates
        if gates_path.is_file()
        else GateBank(loaded.config.num_layers, loaded.config.hidden_size).eval()
    )
    loaded.model.attach_gates(gates)
    return loaded.model, loaded.tokenizer


def telemetry_hook(model_name: str, num_layers: int, exporter: str) -> tuple[StepHook, GateFrameSender]:
    """The service's step-hook work for client rows (see EngineWorker._on_step), trace off."""
    sender = GateFrameSender(exporter, model_name, num_layers, 0.18, shim_id="bench")
    telemetry = StepTelemetry(model_name, DecodeStats(num_layers), sender, trace=None)

    def hook(record: StepRecord) -> None:
        telemetry(
            record.entropies, record.skipped, record.executed_skipped, record.batch_skipped, record.fallback_started
        )

    return hook, sender


@dataclass(frozen=True)
class Run:
    wall: float  # tokens per second
    cpu: float  # tokens per CPU second of this process (all its threads): immune to preemption


def decode_run(
    model: Transformer,
    tokenizer: Tokenizer,
    hook: StepHook | None,
    batch: int,
    tokens: int,
    prompt: list[int],
    recording: int = 0,
) -> Run:
    """`recording`: how many of the `batch` sequences record their gated distribution."""
    engine = GenerationEngine(
        model,
        tokenizer,
        model_name="bench",
        policy=SkipPolicyConfig(),
        max_batch_size=batch,
        max_seq_len=len(prompt) + tokens + 1,
        step_hook=hook,
    )
    for i in range(batch):
        engine.submit(prompt, SamplingParams(max_tokens=tokens), record=i < recording)
    engine.step()  # admission (prefill) and the first step are outside the timed part
    wall, cpu = time.perf_counter(), time.process_time()
    steps = 0
    while engine.has_work():
        engine.step()
        steps += 1
    decoded = steps * batch
    return Run(decoded / (time.perf_counter() - wall), decoded / (time.process_time() - cpu))


def hook_cost(
    model: Transformer, tokenizer: Tokenizer, hook: StepHook, batch: int, tokens: int, prompt: list[int]
) -> tuple[float, float]:
    """-> (median seconds inside the hook per step, median seconds of the step without it)."""
    hook_times: list[float] = []
    step_times: list[float] = []

    def timed(record: StepRecord) -> None:
        started = time.perf_counter()
        hook(record)
        hook_times.append(time.perf_counter() - started)
        step_times.append(record.step_seconds)

    decode_run(model, tokenizer, timed, batch, tokens, prompt)
    return statistics.median(hook_times), statistics.median(step_times)


def main() -> int:
    parser = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.splitlines()[0])
    parser.add_argument(
        "--model",
        type=Path,
        default=None,
        help="checkpoint folder (default: the demo model if trained, else a random model)",
    )
    parser.add_argument("--random", action="store_true", help="a random model even where the demo model exists")
    parser.add_argument("--layers", type=int, default=12, help="random model: layers")
    parser.add_argument("--hidden", type=int, default=512, help="random model: width")
    parser.add_argument("--batch", type=int, default=4, help="concurrent sequences")
    parser.add_argument("--tokens", type=int, default=96, help="generated tokens per sequence")
    parser.add_argument("--repetitions", type=int, default=9)
    parser.add_argument("--threads", type=int, default=1, help="torch threads")
    parser.add_argument(
        "--shadow-rate", type=float, default=0.0, help="share of the 'on' runs' sequences that record (shadow check)"
    )
    add_flags(parser, ModelSettings, PRECISION_SETTINGS)
    args = parser.parse_args()
    try:
        check_precision(torch.device("cpu"), DTYPES[args.dtype], args.quantization)
    except PrecisionError as exc:
        parser.error(str(exc))
    recording = round(args.shadow_rate * args.batch)
    torch.set_num_threads(args.threads)

    folder = args.model or (DEMO_MODEL_DIR if demo_model_present() and not args.random else None)
    if folder is not None:
        model, tokenizer = load_model(folder, args.dtype, args.quantization)
        described = f"checkpoint {folder}"
    else:
        model, tokenizer = random_model(args.layers, args.hidden, 2048, args.dtype, args.quantization)
        described = f"random model, {args.layers} layers, d={args.hidden}"
    described += f", {args.dtype}, quantization {args.quantization}"
    prompt = list(range(2, 34))
    receiver = subprocess.Popen([sys.executable, "-c", RECEIVER], stdout=subprocess.PIPE, text=True)
    try:
        assert receiver.stdout is not None  # a pipe: stdout=PIPE
        exporter = f"127.0.0.1:{int(receiver.stdout.readline())}"
        hook, sender = telemetry_hook("bench", model.config.num_layers, exporter)
        runs: dict[str, list[Run]] = {"off": [], "on": []}
        decode_run(model, tokenizer, None, args.batch, 8, prompt)  # warm-up
        for repetition in range(args.repetitions):
            order = ("off", "on") if repetition % 2 == 0 else ("on", "off")
            for mode in order:
                on = mode == "on"
                runs[mode].append(
                    decode_run(
                        model,
                        tokenizer,
                        hook if on else None,
                        args.batch,
                        args.tokens,
                        prompt,
                        recording=recording if on else 0,
                    )
                )
        hook_seconds, step_seconds = hook_cost(model, tokenizer, hook, args.batch, args.tokens, prompt)
    finally:
        receiver.kill()
    sender.close()
    print(
        f"{described}; batch {args.batch}, {args.tokens} tokens per sequence, {args.repetitions} "
        f"interleaved repetitions, torch threads {args.threads}; 'on' records {recording} of {args.batch} sequences"
    )
    for mode in ("off", "on"):
        wall = [r.wall for r in runs[mode]]
        print(
            f"telemetry {mode:3}: median {statistics.median(wall):7.1f} tokens/s, best {max(wall):7.1f} "
            f"(runs {', '.join(f'{v:.0f}' for v in wall)}); "
            f"{statistics.median(r.cpu for r in runs[mode]):7.1f} tokens per CPU second"
        )
    print(f"frames sent {sender.sent}, dropped {sum(sender.dropped.values())}")
    print(
        f"hook cost in the engine thread: {hook_seconds * 1e6:.0f} us per step of {step_seconds * 1e3:.2f} ms "
        f"-> ratio {step_seconds / (step_seconds + hook_seconds):.4f}"
    )
    for measure in ("wall", "cpu"):
        paired = statistics.median(
            getattr(on, measure) / getattr(off, measure) for on, off in zip(runs["on"], runs["off"])
        )
        best = max(getattr(r, measure) for r in runs["on"]) / max(getattr(r, measure) for r in runs["off"])
        label = "tokens/s" if measure == "wall" else "tokens per CPU second"
        print(f"ratio on/off, {label}: median of paired runs {paired:.4f}, best runs {best:.4f} (goal >= 0.99)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
