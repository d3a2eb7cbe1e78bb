"""Batched decode benchmark: does skipping pay at batch > 1, with the skip patterns real gates produce?

    .venv/bin/python benchmarks/batch_decode_bench.py [--batches 1,4,8,16] [--steps 48] [--repeats 5]
        [--models 12x512,16x1024] [--compile]

The skip patterns are real: the embedded demo model decodes its held-out text teacher-forced at its
own τ (inference_shim/offline/evaluation.py, the engine's step semantics), and every step's per-row
run mask is recorded. Those masks are then replayed, row by row and step by step, on random models
of 12 × 512 and 16 × 1024 (layer l of a 12-layer model takes the demo's layer at the same relative
depth), through `Transformer.decode_step` with both KV policies. Rows skip different layers, as they
do in a served batch, so this measures what row-partial skipping costs.

Per model, batch size and KV policy, three configurations run interleaved, `--repeats` times, on one
torch thread, timed by the process CPU clock (the machine may be shared); every ratio printed is
paired, the median of each repetition's own ratio, with the lowest and highest in brackets:
  full   the model without gates, every layer for every row;
  τ = 0  gates attached, every layer runs (the gated baseline: what skipping is measured against);
  gated  gates attached, the recorded masks;
  consensus  the recorded masks merged per step by serve's --batch-consensus rule (q = 0.5): only
         whole-batch skips (its quality cost: `layerwatch eval --batch-consensus 0.5`).
Printed: gated ÷ full tokens/s (goal ≥ 1 when ≥ 25 % of row-layer evaluations are skipped), by the
CPU clock and, beside it, by the wall clock (what the other jobs of a shared machine stretch), and
realised (gated ÷ τ = 0) against two ideals 1 / (1 − s·w), w the share of a τ = 0 step spent in
attention + FFN, measured per batch size by a per-layer profile, and s the share of that work the
masks leave undone:
  per row  s = f, the skipped share of row-layer evaluations: every skipped row saves its work, as
           if a layer's cost were proportional to the rows that run it;
  device   s = 1 − Σ cost(rows running the layer) / Σ cost(B), summed over steps and layers, with
           cost(r) this device's measured cost of a layer at r rows (cost(0) = 0): what a skip can
           save on this device (equal to f at batch 1, and whenever cost(r) grows like r).
The whole-batch column gives the skips every row shares (the only ones that save weight reads on a
memory-bound GPU). First, per model, cost(r) ÷ cost(1) for r = 1 .. the largest batch, measured in
the same run: the device ideal's cost table.
`--compile` adds the same model with its layer bodies compiled (Transformer.compile_layers, what
`serve --compile` does), full depth and gated, and prints compiled ÷ eager tokens/s for both.

With CUDA present, a GPU section follows (the model on cuda:0, wall clock with the device
synchronised): tokens/s at full depth, gated and with consensus, and realised ÷ ideal where the ideal
counts only whole-batch skips (decode on a GPU is memory-bound: a layer saves its weight reads only
when no row runs it), w there being the layers' attention + FFN share of the weights a step reads;
with nvidia-ml-py, the GPU's energy per token (NVML's total-energy counter) at full depth and gated.
Toy models leave a GPU launch-bound rather than memory-bound: give `--models` a real size (e.g.
32x4096) for GPU figures.
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
from inference_shim.offline.corpus import read_bible, split_chapters, split_heldout, write_corpus
from inference_shim.offline.evaluation import DecodeStep, heldout_windows, teacher_forced_decode
from inference_shim.offline.gated_model import load_gated_model
from inference_shim.offline.training import text_file_stream
from inference_shim.runtime.demo_model import DEMO_MODEL_DIR
from inference_shim.runtime.model import KV_POLICIES, Block, GateBank, KVCache, Transformer
from inference_shim.runtime.skip_policy import consensus_mask
from inference_shim.service.power import NvmlReader

PROMPT_TOKENS = 16
CONSENSUS = 0.5
MODELS = "12x512,16x1024"  # layers x d


def demo_run_masks(rows: int, steps: int) -> np.ndarray:
    """bool [steps, rows, 16]: the demo model's run masks on `rows` held-out windows at its own τ."""
    gated = load_gated_model(DEMO_MODEL_DIR)
    with tempfile.TemporaryDirectory() as folder:
        _, heldout = write_corpus(split_heldout(split_chapters(read_bible())), Path(folder))
        stream = text_file_stream(gated.loaded.tokenizer, heldout, min_tokens=rows * (steps + PROMPT_TOKENS + 1))
    windows = heldout_windows(stream, steps + PROMPT_TOKENS + 1, rows * steps, PROMPT_TOKENS)[:rows]
    gated.model.attach_gates(gated.gates.gates)
    masks: list[np.ndarray] = []

    def record(step: DecodeStep) -> None:
        masks.append(~step.skipped)

    policy = gated.policy()
    teacher_forced_decode(gated.model, windows, PROMPT_TOKENS, policy, batch_size=rows, on_step=record)
    return np.stack(masks)[:steps]


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
    device = model.embed_tokens.weight.device
    cache = KVCache(config, slots=batch, max_len=PROMPT_TOKENS + steps + 1, dtype=torch.float32, device=device)
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
    cache = KVCache(config, slots=max(rows), max_len=2 * PROMPT_TOKENS, dtype=torch.float32, device="cpu")
    inputs = {}
    for count in rows:
        h = torch.randn(count, config.hidden_size)
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


def cpu_section(recorded: np.ndarray, models: list[tuple[int, int]], batches: list[int], args) -> None:
    costs_of: dict[tuple[int, int], dict[int, float]] = {}  # (layers, d) -> cost(r), r = 1 .. max(batches)
    for layers, hidden in models:
        costs = costs_of[layers, hidden] = row_costs(
            build_model(layers, hidden, vocab=8192), list(range(1, max(batches) + 1))
        )
        print(
            f"{layers} x {hidden}: every layer's decode at R rows ÷ at 1 row, CPU clock (proportional "
            "to the rows would be R): " + ", ".join(f"R = {r}: {c / costs[1]:.2f}" for r, c in costs.items())
        )
    print(
        "| model | batch | KV | skipped | whole-batch | w | full tok/s | gated tok/s | gated / full | wall | "
        f"ideal: per row | device | realised / ideal: per row | device | consensus {CONSENSUS:g}: skipped | "
        "gated / full |" + (" compiled / eager: full | gated |" if args.compile else "")
    )
    print(
        "|---|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"
        + ("---:|---:|" if args.compile else "")
    )
    for layers, hidden in models:
        model = build_model(layers, hidden, vocab=8192)
        torch.manual_seed(1)
        gates = GateBank(layers, hidden).eval()
        compiled = compiled_copy(model) if args.compile else None
        masks_all = for_depth(recorded, layers)
        for batch in batches:
            masks = masks_all[:, :batch]
            no_fallback = np.zeros(batch, dtype=bool)
            merged = np.stack([consensus_mask(step, CONSENSUS, no_fallback) for step in masks])
            f = 1 - masks.mean()
            f_whole = float((~masks).all(axis=1).mean())
            s_device = device_saved_share(masks, costs_of[layers, hidden])
            model.attach_gates(gates)
            w = skippable_share(model, batch, args.steps)
            for kv_policy in KV_POLICIES:
                runs = [
                    ("full", model, None, None),
                    ("tau0", model, gates, None),
                    ("gated", model, gates, masks),
                    ("consensus", model, gates, merged),
                ]
                if compiled is not None:
                    runs += [("compiled full", compiled, None, None), ("compiled gated", compiled, gates, masks)]
                seconds: dict[str, list[float]] = {name: [] for name, *_ in runs}
                walls: dict[str, list[float]] = {name: [] for name, *_ in runs}
                for _ in range(args.repeats):  # interleaved: a slow spell hits every configuration
                    for name, runner, bank, run_masks in runs:
                        runner.attach_gates(bank)
                        metered = metered_decode_run(runner, run_masks, batch, args.steps, kv_policy)
                        seconds[name].append(metered.seconds)
                        walls[name].append(metered.wall)
                rate = {name: batch * args.steps / statistics.median(values) for name, values in seconds.items()}
                speedup = paired(seconds, "gated", "tau0")
                ideal_row, ideal_device = 1 / (1 - f * w), 1 / (1 - s_device * w)
                line = (
                    f"| {layers} x {hidden} | {batch} | {kv_policy} | {f:.1%} | {f_whole:.1%} | {w:.2f} | "
                    f"{rate['full']:.0f} | {rate['gated']:.0f} | {spread(paired(seconds, 'gated', 'full'))} | "
                    f"{spread(paired(walls, 'gated', 'full'))} | {ideal_row:.3f} | {ideal_device:.3f} | "
                    f"{spread(speedup, ideal_row)} | {spread(speedup, ideal_device)} | {1 - merged.mean():.1%} | "
                    f"{spread(paired(seconds, 'consensus', 'full'))} |"
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
    print(f"GPU: {name}; KV policy project; {clock}")
    print(
        "| model | batch | skipped | whole-batch | w (weights) | full tok/s | gated tok/s | gated / full | "
        f"realised / ideal (whole-batch) | consensus {CONSENSUS:g} / full | J/token full | J/token gated |"
    )
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for layers, hidden in models:
        model = build_model(layers, hidden, vocab=8192).to(device)
        torch.manual_seed(1)
        gates = GateBank(layers, hidden).eval().to(device)
        model.attach_gates(gates)
        w = weight_share(model, "project")
        masks_all = for_depth(recorded, layers)
        for batch in batches:
            masks = masks_all[:, :batch]
            no_fallback = np.zeros(batch, dtype=bool)
            merged = np.stack([consensus_mask(step, CONSENSUS, no_fallback) for step in masks])
            f_whole = float((~masks).all(axis=1).mean())
            runs = (("full", None, None), ("tau0", gates, None), ("gated", gates, masks), ("consensus", gates, merged))
            decode_run(model, masks, batch, args.steps, "project")  # warm-up: kernels, allocator
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
                f"| {layers} x {hidden} | {batch} | {1 - masks.mean():.1%} | {f_whole:.1%} | {w:.2f} | "
                f"{rate['full']:.0f} | {rate['gated']:.0f} | {spread(paired(seconds, 'gated', 'full'))} | "
                f"{spread(paired(seconds, 'gated', 'tau0'), ideal)} | {spread(paired(seconds, 'consensus', 'full'))} | "
                f"{per_token['full']} | {per_token['gated']} |",
                flush=True,
            )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batches", default="1,4,8,16", help="comma-separated batch sizes")
    parser.add_argument("--steps", type=int, default=48, help="decode steps per measurement")
    parser.add_argument("--repeats", type=int, default=5, help="interleaved repetitions per configuration")
    parser.add_argument("--models", default=MODELS, help="comma-separated random models, layers x d")
    parser.add_argument("--compile", action="store_true", help="also measure the compiled layer bodies (CPU)")
    args = parser.parse_args()
    batches = [int(b) for b in args.batches.split(",")]
    models = parse_models(args.models)
    torch.set_num_threads(1)

    recorded = demo_run_masks(max(batches), args.steps)
    print(
        f"demo model's run masks: {recorded.shape[1]} rows x {recorded.shape[0]} steps, "
        f"{1 - recorded.mean():.1%} of row-layer evaluations skipped"
    )
    cpu_section(recorded, models, batches, args)
    if torch.cuda.is_available():
        device = torch.device("cuda", 0)
        gpu_section(recorded, models, batches, args, device, gpu_energy(device))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
