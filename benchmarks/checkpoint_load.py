"""Checkpoint load benchmark: what the finite-weights check costs `load_checkpoint`.

    .venv/bin/python benchmarks/checkpoint_load.py [--model 16x1024] [--repeats 5] [--dtypes float32,bfloat16]

Builds the random benchmark model (decode_bench.build_model, vocabulary 8192) in a temporary folder,
saves it as a checkpoint folder, and loads it `--repeats` times per dtype with the check (as every
command loads) and without it (`non_finite_problem` replaced by a no-op), in pairs whose order
alternates, on one torch thread, timed by the wall clock and the process CPU clock; the file is read
once before, so every load reads it from the page cache. Printed per dtype: the median seconds of
each, checked ÷ unchecked per pair, median (lowest–highest), and the check alone: its CPU seconds
over every weight as the loader converts it (the load's own noise on a shared machine hides it).
Results go into docs/model.md ("Checkpoint folder").
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
from safetensors import safe_open

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.batch_decode_bench import parse_models, spread
from benchmarks.decode_bench import bench_tokenizer, build_model
from layerwatch.inference_shim.runtime import checkpoint
from layerwatch.inference_shim.runtime.checkpoint import DTYPES, WEIGHTS_FILE, load_checkpoint, save_checkpoint
from layerwatch.inference_shim.runtime.model import non_finite_problem

VOCAB = 8192


def timed_load(folder: Path, dtype: torch.dtype, checked: bool) -> tuple[float, float]:
    """(wall, CPU) seconds of one load_checkpoint; `checked` False loads with the check a no-op."""
    check = checkpoint.non_finite_problem
    if not checked:
        checkpoint.non_finite_problem = lambda *args, **kwargs: None
    try:
        wall, cpu = time.perf_counter(), time.process_time()
        loaded = load_checkpoint(folder, dtype=dtype)
        wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
    finally:
        checkpoint.non_finite_problem = check
    del loaded
    return wall, cpu


def check_seconds(folder: Path, dtype: torch.dtype) -> float:
    """CPU seconds of the check alone, over every weight as the loader converts it."""
    with safe_open(folder / WEIGHTS_FILE, framework="pt") as reader:
        names = list(reader.keys())
        tensors = {name: reader.get_tensor(name).to(dtype) for name in names}
    start = time.process_time()
    problems = [non_finite_problem(name, tensor) for name, tensor in tensors.items()]
    seconds = time.process_time() - start
    assert not any(problems), problems
    return seconds


def main() -> int:
    parser = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="16x1024", help="the random model, layers x d")
    parser.add_argument("--repeats", type=int, default=5, help="pairs per dtype")
    parser.add_argument("--dtypes", default="float32,bfloat16", help=f"comma-separated, of {', '.join(DTYPES)}")
    args = parser.parse_args()
    ((layers, hidden),) = parse_models(args.model)
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp) / "model"
        model = build_model(layers, hidden, vocab=VOCAB)
        save_checkpoint(model, bench_tokenizer(VOCAB), folder)
        weights = sum(t.numel() * t.element_size() for t in model.state_dict().values()) / 2**20
        del model
        print(f"{args.model}: {weights:.0f} MiB of float32 weights, {args.repeats} pairs per dtype, one thread")
        print(
            "| load dtype | unchecked s (wall) | checked s (wall) | checked / unchecked: wall | CPU "
            "| the check alone, CPU s |"
        )
        print("|---|---|---|---|---|---|")
        for name in args.dtypes.split(","):
            dtype = DTYPES[name]
            timed_load(folder, dtype, checked=True)  # the page cache, and a first check that it loads
            runs: dict[bool, list[tuple[float, float]]] = {True: [], False: []}
            for repeat in range(args.repeats):
                for checked in (True, False) if repeat % 2 else (False, True):
                    runs[checked].append(timed_load(folder, dtype, checked))
            wall = [c[0] / u[0] for c, u in zip(runs[True], runs[False], strict=True)]
            cpu = [c[1] / u[1] for c, u in zip(runs[True], runs[False], strict=True)]
            medians = [statistics.median(w for w, _ in runs[checked]) for checked in (False, True)]
            alone = sorted(check_seconds(folder, dtype) for _ in range(args.repeats))
            print(
                f"| {name} | {medians[0]:.3f} | {medians[1]:.3f} | {spread(wall)} | {spread(cpu)} "
                f"| {statistics.median(alone):.3f} ({alone[0]:.3f}–{alone[-1]:.3f}) |"
            )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
