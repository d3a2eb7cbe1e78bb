"""What the gate-importance correlations cost the shim: a scrape after a new shadow pass, a cached
scrape, and folding one pass in, for the demo's 16 layers and for 80.

    .venv/bin/python benchmarks/gate_importance_scrape.py
    .venv/bin/python benchmarks/gate_importance_scrape.py --layers 16,32,80 --positions 48 --repeats 50

Torch-free: `LayerSignalStats` (layerwatch/gate_importance.py) with full per-layer buffers of
GATE_LAYER_SAMPLES random pairs, and passes of `--positions` decode positions. A scrape after a
pass sorts every layer's buffer twice (the correlations are cached per pass, so later scrapes only
copy the counters); `observe` runs in the engine thread after a shadow job, inside its duty cycle
(docs/service.md, "Layer signals"). Prints the median and the 10th-90th percentile in milliseconds.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from layerwatch.catalog import GATE_LAYER_SAMPLES
from layerwatch.gate_importance import LayerSignalStats


def a_pass(rng: np.random.Generator, positions: int, layers: int) -> SimpleNamespace:
    update = rng.lognormal(-2.0, 0.5, size=(positions, layers))
    return SimpleNamespace(
        relative_update=update,
        attention_kl=rng.uniform(0.0, 3.0, size=(positions, layers)),
        gate_score=rng.uniform(0.05, 0.35, size=(positions, layers)),
    )


def milliseconds(samples: list[float]) -> str:
    ms = 1000 * np.array(samples)
    return f"{np.median(ms):.2f} ms ({np.percentile(ms, 10):.2f}-{np.percentile(ms, 90):.2f})"


def measure(layers: int, positions: int, repeats: int) -> dict[str, list[float]]:
    rng = np.random.default_rng(0)
    stats = LayerSignalStats(layers)
    while int(stats.snapshot().layer_samples.min()) < GATE_LAYER_SAMPLES:  # full buffers, as in steady state
        stats.observe(a_pass(rng, positions, layers))
    times: dict[str, list[float]] = {"observe": [], "scrape after a pass": [], "cached scrape": []}
    for _ in range(repeats):
        signals = a_pass(rng, positions, layers)
        started = time.perf_counter()
        stats.observe(signals)
        times["observe"].append(time.perf_counter() - started)
        started = time.perf_counter()
        stats.snapshot()
        times["scrape after a pass"].append(time.perf_counter() - started)
        started = time.perf_counter()
        stats.snapshot()
        times["cached scrape"].append(time.perf_counter() - started)
    return times


def main() -> int:
    parser = argparse.ArgumentParser(
        allow_abbrev=False, description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--layers", default="16,80", help="comma-separated layer counts (default %(default)s)")
    parser.add_argument("--positions", type=int, default=24, help="decode positions per shadow pass")
    parser.add_argument("--repeats", type=int, default=30)
    args = parser.parse_args()
    print(f"{GATE_LAYER_SAMPLES} pairs per layer, passes of {args.positions} positions, {args.repeats} repeats")
    for layers in (int(n) for n in args.layers.split(",")):
        times = measure(layers, args.positions, args.repeats)
        print(f"{layers} layers: " + "; ".join(f"{name} {milliseconds(t)}" for name, t in times.items()))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
