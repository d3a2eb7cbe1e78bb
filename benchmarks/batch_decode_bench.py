"""Batched decode benchmark: is skipping faster than full depth at every batch size, with the skip
patterns real gates produce and the depth execution serve runs?

    .venv/bin/python benchmarks/batch_decode_bench.py [--batches 1,4,8,16] [--steps 48] [--repeats 5]
        [--models 12x512,16x1024] [--compile] [--dtype bfloat16] [--quantization int8|int4]

The skip patterns are real: the embedded demo model decodes its held-out text teacher-forced at its
own τ (layerwatch/inference_shim/offline/evaluation.py, the engine's step semantics), and every step's per-row
run mask (what each row's skip rule decided) is recorded. Those masks are then replayed, row by row
and step by step, on random models of 12 × 512 and 16 × 1024 (layer l of a 12-layer model takes the
demo's layer at the same relative depth), through `Transformer.decode_step` with both KV policies.

Per model and KV policy the depth execution's costs are measured first (MeasuredDepthCosts, what
`serve` measures at start: the most running rows for which a layer's row-partial path is faster than
the whole batch), and each step's decided masks go through the default plan (depth_execution.py:
row-partial up to that limit, else whole, with the batch consensus 0.5). Configurations, interleaved
`--repeats` times on one torch thread, timed by the process CPU clock (the machine may be shared):
  full     the model without gates, every layer for every row;
  τ = 0    gates attached, every layer runs (the gated baseline);
  gated    the default plan's executed masks;
  rows     the decided masks row by row (`--depth-execution rows`: each row exactly as it decided).
Every ratio printed is paired, the median of each repetition's own ratio, with the lowest and
highest in brackets. Printed per batch size: the measured row-partial limit, the decided and
executed skip shares and the layers run for rows whose rule skipped them, gated ÷ full by the CPU
clock and by the wall clock, rows ÷ full, realised (gated ÷ τ = 0) against the device ideal, and
the quality cost: the demo model's perplexity increase over its full depth on its held-out windows
when it decodes with the same plan (the same limit) and with rows. The device ideal is
1 / (1 − s·w): w the share of a τ = 0 step spent in attention + FFN (a per-layer profile), s the
share of full depth's layer cost the executed masks leave undone when a layer that r rows run costs
this device's measured cost(r) (printed first per model, r = 1 .. the largest batch; cost(0) = 0).
`--compile` adds the same model with its layer bodies compiled (Transformer.compile_layers, what
`serve --compile` does), full depth and gated, and prints compiled ÷ eager tokens/s for both.

With CUDA present, a GPU section follows (the model on cuda:0 in `--gpu-dtype`, bfloat16 unless told
otherwise, as GPUs serve; wall clock with the device synchronised, its own measured limits):
tokens/s at full depth and gated, and realised ÷ ideal where the ideal counts only whole-batch skips
(decode on a GPU is memory-bound: a layer saves its weight reads only when no row runs it), w there
being the layers' attention + FFN share of the weights a step reads; with nvidia-ml-py, the GPU's
energy per token (NVML's total-energy counter) at full depth and gated. Toy models leave a GPU
launch-bound rather than memory-bound: give `--models` a real size (e.g. 32x4096) for GPU figures.
Results go into docs/performance.md ("Decode at batch > 1").
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import cast

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.decode_bench import build_model, skippable_spans
from layerwatch.inference_shim.offline.corpus import read_bible, split_chapters, split_heldout, write_corpus
from layerwatch.inference_shim.offline.evaluation import DecodeStep, heldout_windows, teacher_forced_decode
from layerwatch.inference_shim.offline.gated_model import GatedModel, load_gated_model
from layerwatch.inference_shim.offline.training import text_file_stream
from layerwatch.inference_shim.runtime.checkpoint import DTYPES
from layerwatch.inference_shim.runtime.demo_model import DEMO_MODEL_DIR
from layerwatch.inference_shim.runtime.depth_execution import (
    DepthExecution,
    DepthExecutionConfig,
    FixedDepthCosts,
    MeasuredDepthCosts,
)
from layerwatch.inference_shim.runtime.model import KV_POLICIES, Block, GateBank, KVCache, Transformer
from layerwatch.inference_shim.runtime.quantization import PrecisionError, check_precision
from layerwatch.inference_shim.service.power import NvmlReader
from layerwatch.inference_shim.service.settings import PRECISION_SETTINGS, ModelSettings
from layerwatch.settings import add_flags

PROMPT_TOKENS = 16
MODELS = "12x512,16x1024"  # layers x d
DEFAULT = DepthExecutionConfig()  # what serve and eval run
QUALITY_WINDOWS = 32  # demo windows of 128 tokens whose perplexity gives a plan's quality cost


def demo_heldout(rows: int, window: int) -> tuple[GatedModel, torch.Tensor]:
    """The demo model (gates attached) and `rows` of its held-out windows of `window` tokens."""
    gated = load_gated_model(DEMO_MODEL_DIR)
    with tempfile.TemporaryDirectory() as folder:
        _, heldout = write_corpus(split_heldout(split_chapters(read_bible())), Path(folder))
        stream = text_file_stream(gated.loaded.tokenizer, heldout, min_tokens=rows * window)
    gated.model.attach_gates(gated.gates.gates)
    return gated, heldout_windows(stream, window, rows * (window - PROMPT_TOKENS), PROMPT_TOKENS)[:rows]


def demo_run_masks(rows: int, steps: int) -> np.ndarray:
    """bool [steps, rows, 16]: the demo model's decided run masks on `rows` held-out windows at its own τ."""
    gated, windows = demo_heldout(rows, steps + PROMPT_TOKENS + 1)
    masks: list[np.ndarray] = []

    def record(step: DecodeStep) -> None:
        masks.append(~step.skipped)

    teacher_forced_decode(gated.model, windows, PROMPT_TOKENS, gated.policy(), batch_size=rows, on_step=record)
    return np.stack(masks)[:steps]


class DemoQuality:
    """The quality cost of a plan: the demo model's perplexity increase over full depth on its
    held-out windows when its batches of B run the default plan with a given row-partial limit (or
    every row as it decided), cached per (B, limit, KV policy)."""

    def __init__(self) -> None:
        self.gated, self.windows = demo_heldout(QUALITY_WINDOWS, 128)
        self._full: dict[int, float] = {}
        self._increase: dict[tuple, float] = {}

    def increase(self, batch: int, limit: int | None, kv_policy: str) -> float:
        """limit None: the rows mode."""
        key = (batch, limit, kv_policy)
        if key not in self._increase:
            model = self.gated.model
            if batch not in self._full:
                model.attach_gates(None)
                self._full[batch] = teacher_forced_decode(
                    model, self.windows, PROMPT_TOKENS, None, batch_size=batch
                ).perplexity
                model.attach_gates(self.gated.gates.gates)
            depth = None if limit is None else DepthExecution(DEFAULT, FixedDepthCosts({batch: limit}))
            totals = teacher_forced_decode(
                model, self.windows, PROMPT_TOKENS, self.gated.policy(), kv_policy, batch_size=batch, depth=depth
            )
            self._increase[key] = totals.perplexity / self._full[batch] - 1
        return self._increase[key]


def planned(masks: np.ndarray, depth: DepthExecution) -> np.ndarray:
    """The executed masks [steps, B, L] the plan makes of the decided ones (no row at full depth)."""
    no_row = np.zeros(masks.shape[1], dtype=bool)
    return np.stack([depth.plan(step, no_row) for step in masks])


def for_depth(masks: np.ndarray, layers: int) -> np.ndarray:
    """The masks of a model with `layers` layers: each takes the demo layer at its relative depth."""
    source = masks.shape[2]
    picks = np.round(np.arange(layers) * (source - 1) / (layers - 1)).astype(int)
    return masks[:, :, picks]


def decode_run(model: Transformer, masks: np.ndarray | None, batch: int, steps: int, kv_policy: str) -> float:
    """Seconds of `steps` decode steps of `batch` rows (masks [steps, batch, L] or None), after a
    full-depth prompt per row: the process CPU clock on a CPU, the wall clock around the
    synchronised device on a GPU (which runs asynchronously)."""
    return metered_decode_run(model, masks, batch, steps, kv_policy).seconds


@dataclass(frozen=True)
class Metered:
    """One metered run of decode steps."""

    seconds: float  # decode_run's: the process CPU clock on a CPU, the synchronised wall clock on a GPU
    wall: float  # the wall clock over the same steps (on a CPU: what a shared machine's other jobs stretch)
    joules: float | None  # what the cumulative energy reading grew by (None without one)


def metered_decode_run(
    model: Transformer,
    masks: np.ndarray | None,
    batch: int,
    steps: int,
    kv_policy: str,
    energy: Callable[[], float] | None = None,
) -> Metered:
    """decode_run's seconds, the wall clock, and the joules `energy` (a cumulative reading) grew by
    over the same decode steps."""
    config = model.config
    weight = model.embed_tokens.weight
    device = weight.device
    cache = KVCache(config, slots=batch, max_len=PROMPT_TOKENS + steps + 1, dtype=weight.dtype, device=device)
    generator = torch.Generator().manual_seed(0)
    prompts = torch.randint(2, config.vocab_size, (batch, PROMPT_TOKENS), generator=generator).to(device)
    for slot in range(batch):
        model.prefill(prompts[slot], cache, slot)
    tokens = prompts[:, -1]
    slots = list(range(batch))
    on_gpu = device.type == "cuda"
    clock = time.perf_counter if on_gpu else time.process_time
    if on_gpu:
        torch.cuda.synchronize(device)
    joules_before = energy() if energy is not None else None
    started, wall_started = clock(), time.perf_counter()
    for step in range(steps):
        positions = [PROMPT_TOKENS + step] * batch
        logits, _ = model.decode_step(
            tokens, cache, slots, positions, None if masks is None else masks[step], kv_policy
        )
        tokens = logits.argmax(dim=-1)
    if on_gpu:
        torch.cuda.synchronize(device)
    seconds, wall = clock() - started, time.perf_counter() - wall_started
    joules = energy() - joules_before if energy is not None and joules_before is not None else None
    return Metered(seconds, wall, joules)


def skippable_share(model: Transformer, batch: int, steps: int) -> float:
    """w at this batch size: the share of a τ = 0 decode step spent in what a skip removes
    (decode_bench.skippable_spans); one thread, so the CPU clock measures it."""
    with skippable_spans(model, time.process_time) as (starts, ends):
        total = decode_run(model, None, batch, steps, "project")
    # The prefill also passes the hooks: only the decode steps' last `steps * L` spans count.
    spans = steps * len(model.layers)
    return sum(e - s for s, e in zip(starts[-spans:], ends[-spans:])) / total


def row_costs(model: Transformer, rows: list[int], repeats: int = 20) -> dict[int, float]:
    """CPU seconds of one pass through every layer's decode (attention + FFN) for R rows, R in
    `rows`: a batch of R with nothing gathered, so what R running rows cost this device at least.
    The row counts take turns, so that a slow spell of a shared machine hits all of them."""
    config = model.config
    dtype = model.embed_tokens.weight.dtype
    cache = KVCache(config, slots=max(rows), max_len=2 * PROMPT_TOKENS, dtype=dtype, device="cpu")
    inputs = {}
    for count in rows:
        h = torch.randn(count, config.hidden_size, dtype=dtype)
        inputs[count] = h, model.step_rows(cache, list(range(count)), [PROMPT_TOKENS] * count)
    times: dict[int, list[float]] = {count: [] for count in rows}
    with torch.no_grad():
        for _ in range(repeats):
            for count, (h, step) in inputs.items():
                started = time.process_time()
                for l, block in enumerate(cast("Iterable[Block]", model.layers)):  # nn.ModuleList is not generic
                    block.decode(h, block.input_layernorm(h), step, cache, l, PROMPT_TOKENS + 1)
                times[count].append(time.process_time() - started)
    return {count: statistics.median(values) for count, values in times.items()}


def device_saved_share(masks: np.ndarray, costs: dict[int, float]) -> float:
    """s of the device ideal: the share of full depth's layer cost (every layer at B rows) that the
    masks [steps, B, L] leave undone, a layer that r rows run costing costs[r] (nothing at r = 0)."""
    steps, batch, layers = masks.shape
    cost = np.array([0.0, *(costs[r] for r in range(1, batch + 1))])
    return 1 - cost[masks.sum(axis=1)].sum() / (steps * layers * cost[batch])


def paired(seconds: dict[str, list[float]], faster: str, slower: str) -> list[float]:
    """`faster`'s speed ÷ `slower`'s in each repetition (one repetition runs every configuration
    back to back, so a slow spell of the shared machine divides out)."""
    return [s / f for f, s in zip(seconds[faster], seconds[slower], strict=True)]


def spread(ratios: list[float], scale: float = 1.0) -> str:
    """ "median (lowest–highest)" of the ratios ÷ scale: the figure, and how far single repetitions
    strayed from it."""
    values = sorted(r / scale for r in ratios)
    median = f"{statistics.median(values):.3f}"
    return median if len(values) == 1 else f"{median} ({values[0]:.2f}–{values[-1]:.2f})"


def parse_models(text: str) -> list[tuple[int, int]]:
    """ "12x512,16x1024" -> [(12, 512), (16, 1024)] (layers, d)."""
    models = [(int(layers), int(hidden)) for layers, hidden in (item.split("x") for item in text.split(","))]
    for layers, _ in models:
        if layers < 2:  # for_depth maps the demo's first and last layers onto the model's
            raise ValueError(f"--models {text}: a model needs at least 2 layers")
    return models


def compiled_copy(model: Transformer) -> Transformer:
    """The same weights with the layer bodies compiled, as `serve --compile` runs them."""
    copy = Transformer(model.config).eval()
    copy.load_state_dict(model.state_dict())
    copy.compile_layers()
    for batch in (1, 2):  # compile_layers builds the graphs for the engine's inference mode, these
        decode_run(copy, None, batch, 2, "project")  # runs the ones for this benchmark's no_grad
    return copy


def measured_limits(model: Transformer, batches: list[int], kv_policy: str) -> MeasuredDepthCosts:
    """The depth execution's costs of `model` for these batch sizes, measured as serve does, printed."""
    costs = MeasuredDepthCosts(model, kv_policy)
    costs.prepare(batches)
    print(f"{model.config.num_layers} x {model.config.hidden_size}, {kv_policy}: row-partial up to {costs.table()}")
    return costs


def cpu_section(
    recorded: np.ndarray, models: list[tuple[int, int]], batches: list[int], args, quality: DemoQuality | None
) -> None:
    """The CPU table; `quality` None leaves its columns n/a (the tests: no demo model decoding)."""
    costs_of: dict[tuple[int, int], dict[int, float]] = {}  # (layers, d) -> cost(r), r = 1 .. max(batches)
    for layers, hidden in models:
        costs = costs_of[layers, hidden] = row_costs(
            build_model(layers, hidden, 8192, args.dtype, args.quantization), list(range(1, max(batches) + 1))
        )
        print(
            f"{layers} x {hidden}: every layer's decode at R rows ÷ at 1 row, CPU clock (proportional "
            "to the rows would be R): " + ", ".join(f"R = {r}: {c / costs[1]:.2f}" for r, c in costs.items())
        )
    print(
        f"depth execution {DEFAULT.describe()} (gated) against rows (every row as it decided), "
        "demo perplexity increase: its windows decoded with the same plan"
    )
    print(
        "| model | batch | KV | row-partial up to | skipped: decided | executed | run though skipped | whole-batch "
        "| w | full tok/s | gated tok/s | gated / full | wall | rows / full | ideal (device) | realised / ideal "
        "| demo perplexity: rows | gated |" + (" compiled / eager: full | gated |" if args.compile else "")
    )
    print("|---|---:|---|" + "---:|" * 15 + ("---:|---:|" if args.compile else ""))
    for layers, hidden in models:
        model = build_model(layers, hidden, 8192, args.dtype, args.quantization)
        torch.manual_seed(1)
        gates = GateBank(layers, hidden).eval().to(DTYPES[args.dtype])
        compiled = compiled_copy(model) if args.compile else None
        masks_all = for_depth(recorded, layers)
        limits = {kv: measured_limits(model, batches, kv) for kv in KV_POLICIES}
        for batch in batches:
            decided = masks_all[:, :batch]
            model.attach_gates(gates)
            w = skippable_share(model, batch, args.steps)
            for kv_policy in KV_POLICIES:
                limit = limits[kv_policy].row_partial_limit(batch)
                executed = planned(decided, DepthExecution(DEFAULT, FixedDepthCosts({batch: limit})))
                runs = [
                    ("full", model, None, None),
                    ("tau0", model, gates, None),
                    ("gated", model, gates, executed),
                    ("rows", model, gates, decided),
                ]
                if compiled is not None:
                    runs += [("compiled full", compiled, None, None), ("compiled gated", compiled, gates, executed)]
                seconds: dict[str, list[float]] = {name: [] for name, *_ in runs}
                walls: dict[str, list[float]] = {name: [] for name, *_ in runs}
                for _ in range(args.repeats):  # interleaved: a slow spell hits every configuration
                    for name, runner, bank, run_masks in runs:
                        runner.attach_gates(bank)
                        metered = metered_decode_run(runner, run_masks, batch, args.steps, kv_policy)
                        seconds[name].append(metered.seconds)
                        walls[name].append(metered.wall)
                rate = {name: batch * args.steps / statistics.median(values) for name, values in seconds.items()}
                ideal = 1 / (1 - device_saved_share(executed, costs_of[layers, hidden]) * w)
                cost = (
                    (
                        f"{quality.increase(batch, None, kv_policy):+.2%}",
                        f"{quality.increase(batch, limit, kv_policy):+.2%}",
                    )
                    if quality is not None
                    else ("n/a", "n/a")
                )
                line = (
                    f"| {layers} x {hidden} | {batch} | {kv_policy} | {limit} | {1 - decided.mean():.1%} | "
                    f"{1 - executed.mean():.1%} | {(executed & ~decided).mean():.1%} | "
                    f"{float((~executed).all(axis=1).mean()):.1%} | {w:.2f} | "
                    f"{rate['full']:.0f} | {rate['gated']:.0f} | "
                    f"{spread(paired(seconds, 'gated', 'full'))} | {spread(paired(walls, 'gated', 'full'))} | "
                    f"{spread(paired(seconds, 'rows', 'full'))} | {ideal:.3f} | "
                    f"{spread(paired(seconds, 'gated', 'tau0'), ideal)} | {cost[0]} | {cost[1]} |"
                )
                if compiled is not None:
                    line += (
                        f" {spread(paired(seconds, 'compiled full', 'full'))} |"
                        f" {spread(paired(seconds, 'compiled gated', 'gated'))} |"
                    )
                print(line, flush=True)


def weight_share(model: Transformer, kv_policy: str) -> float:
    """w on a memory-bound GPU: the share of the weights a decode step reads that a skipped layer
    leaves unread: its attention and FFN, but for the K/V projections under `project` (they still
    run). The norms, the gates and the LM head are always read; of the embedding table, one row."""
    kept = ("k_proj.", "v_proj.") if kv_policy == "project" else ()
    skippable = sum(
        p.numel()
        for block in model.layers
        for part in ("self_attn", "mlp")
        for name, p in block.get_submodule(part).named_parameters()
        if not name.startswith(kept)
    )
    read = sum(
        p.numel()
        for name, p in model.named_parameters()  # the attached gates included
        if model.config.tie_word_embeddings or not name.startswith("embed_tokens.")
    )
    return skippable / read


def gpu_energy(device: torch.device) -> Callable[[], float] | None:
    """The joules `device`'s GPU has used since its driver loaded, as a callable reading NVML's
    total-energy counter; None (and a line saying why) where NVML or the counter is missing."""
    try:
        reader = NvmlReader()
        readings = reader()
    except Exception as exc:  # no nvidia-ml-py, or NVML does not work here: no energy column
        print(f"(no GPU energy: {type(exc).__name__}: {exc})")
        return None
    # NVML numbers GPUs in PCI order, CUDA by its own order and CUDA_VISIBLE_DEVICES: match by UUID.
    uuid = "GPU-" + str(torch.cuda.get_device_properties(device).uuid).removeprefix("GPU-")
    matching = [i for i, reading in enumerate(readings) if reading.uuid == uuid]
    if not matching:
        print(f"(no GPU energy: NVML lists no GPU with {device}'s UUID {uuid})")
        return None
    (index,) = matching
    joules = readings[index].energy_joules
    if joules is None:
        print(f"(no GPU energy: GPU {index} has no total-energy counter)")
        return None

    def gpu_joules() -> float:
        reading = reader()[index].energy_joules
        if reading is None:
            raise RuntimeError(f"GPU {index}'s total-energy counter stopped answering")
        return reading

    return gpu_joules


def gpu_section(
    recorded: np.ndarray,
    models: list[tuple[int, int]],
    batches: list[int],
    args,
    device: torch.device,
    energy: Callable[[], float] | None,
) -> None:
    """The GPU table, `energy` the cumulative joules reading (gpu_energy) behind its J/token columns
    ("n/a" without one). Any device runs it (the tests run it on the CPU)."""
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else str(device)
    clock = "wall clock, device synchronised" if device.type == "cuda" else "CPU clock"  # as metered_decode_run
    dtype = DTYPES[args.gpu_dtype]
    print(f"GPU: {name}; {args.gpu_dtype}; KV policy project; {clock}; depth execution {DEFAULT.describe()}")
    print(
        "| model | batch | row-partial up to | skipped: decided | executed | whole-batch | w (weights) | full tok/s "
        "| gated tok/s | gated / full | realised / ideal (whole-batch) | rows / full | J/token full | J/token gated |"
    )
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for layers, hidden in models:
        model = build_model(layers, hidden, vocab=8192).to(device, dtype)
        torch.manual_seed(1)
        gates = GateBank(layers, hidden).eval().to(device, dtype)
        model.attach_gates(gates)
        w = weight_share(model, "project")
        masks_all = for_depth(recorded, layers)
        costs = measured_limits(model, batches, "project")
        for batch in batches:
            decided = masks_all[:, :batch]
            limit = costs.row_partial_limit(batch)
            executed = planned(decided, DepthExecution(DEFAULT, FixedDepthCosts({batch: limit})))
            f_whole = float((~executed).all(axis=1).mean())
            runs = (("full", None, None), ("tau0", gates, None), ("gated", gates, executed), ("rows", gates, decided))
            decode_run(model, executed, batch, args.steps, "project")  # warm-up: kernels, allocator
            seconds: dict[str, list[float]] = {name: [] for name, *_ in runs}
            joules: dict[str, list[float]] = {name: [] for name, *_ in runs}
            for _ in range(args.repeats):
                for name, bank, run_masks in runs:
                    model.attach_gates(bank)
                    metered = metered_decode_run(model, run_masks, batch, args.steps, "project", energy)
                    seconds[name].append(metered.seconds)
                    if metered.joules is not None:
                        joules[name].append(metered.joules / (batch * args.steps))
            rate = {name: batch * args.steps / statistics.median(values) for name, values in seconds.items()}
            ideal = 1 / (1 - f_whole * w)
            per_token = {name: f"{statistics.median(v):.3g}" if v else "n/a" for name, v in joules.items()}
            print(
                f"| {layers} x {hidden} | {batch} | {limit} | {1 - decided.mean():.1%} | {1 - executed.mean():.1%} | "
                f"{f_whole:.1%} | {w:.2f} | {rate['full']:.0f} | {rate['gated']:.0f} | "
                f"{spread(paired(seconds, 'gated', 'full'))} | {spread(paired(seconds, 'gated', 'tau0'), ideal)} | "
                f"{spread(paired(seconds, 'rows', 'full'))} | {per_token['full']} | {per_token['gated']} |",
                flush=True,
            )


def main() -> int:
    parser = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.splitlines()[0])
    parser.add_argument("--batches", default="1,4,8,16", help="comma-separated batch sizes")
    parser.add_argument("--steps", type=int, default=48, help="decode steps per measurement")
    parser.add_argument("--repeats", type=int, default=5, help="interleaved repetitions per configuration")
    parser.add_argument("--models", default=MODELS, help="comma-separated random models, layers x d")
    parser.add_argument("--compile", action="store_true", help="also measure the compiled layer bodies (CPU)")
    parser.add_argument("--gpu-dtype", default="bfloat16", choices=tuple(DTYPES), help="the GPU section's weights")
    add_flags(parser, ModelSettings, PRECISION_SETTINGS)  # the CPU sections; the GPU section reads --gpu-dtype
    args = parser.parse_args()
    try:
        check_precision(torch.device("cpu"), DTYPES[args.dtype], args.quantization)
    except PrecisionError as exc:
        parser.error(str(exc))
    if args.compile and args.quantization != "none":
        parser.error("--compile copies the float weights' state: measure it with --quantization none")
    batches = [int(b) for b in args.batches.split(",")]
    models = parse_models(args.models)
    torch.set_num_threads(1)

    recorded = demo_run_masks(max(batches), args.steps)
    print(
        f"demo model's decided run masks: {recorded.shape[1]} rows x {recorded.shape[0]} steps, "
        f"{1 - recorded.mean():.1%} of row-layer evaluations skipped"
    )
    cpu_section(recorded, models, batches, args, DemoQuality())
    if torch.cuda.is_available() and args.quantization != "none":
        print(f"GPU section left out: --quantization {args.quantization} runs on torch's CPU kernels only")
    elif torch.cuda.is_available():
        device = torch.device("cuda", 0)
        gpu_section(recorded, models, batches, args, device, gpu_energy(device))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
