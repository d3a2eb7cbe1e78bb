"""Gate-importance correlations of a model, healthy and with the gate drills, as the shim measures them.

    .venv/bin/python benchmarks/gate_signals.py                      # the demo model
    .venv/bin/python benchmarks/gate_signals.py --requests 300 --explore
    .venv/bin/python benchmarks/gate_signals.py --model DIR --temperatures 0

What the shim does with `--shadow-rate`, offline: completions of the load generator's prompts
(layerwatch/demo/loadgen.py) by the real GenerationEngine with each gate bank attached (the served gates, then
`--shuffle-gates`' and `--scramble-gates'`), each re-run at full depth with the layer probe
(`full_depth_agreement(..., layer_signals=True)`) and folded into a `LayerSignalStats`. After every
pass once the buffers are full it records the shim's gauges: the within-layer headline
(`layerwatch_gate_importance_correlation`), the between-layer ordering and each layer's own value;
and, for comparison, the pooled Spearman correlation over the last 4096 (token, layer) pairs of the
same position that the shim exported before the within-layer statistic. `--temperatures` cycles
the requests' sampling (0: greedy). Per bank it prints those ranges, the skip ratio, the exporter's
bimodality verdict on windows of 5,000 decode-time entropies, the shadow agreement of the greedy
requests, and the shadow pass's time with and without the probe.

`--explore` adds gate banks that are not drills of `layerwatch serve`, for the question "can a
feature permutation damage the gates and keep two entropy humps?": the first projection reading k
features cycled among themselves (the rest in place), and the full `--scramble-gates` permutation
with each gate's first biases moved so that its hidden units keep their mean pre-activation over
the healthy hidden states (then every layer keeps about its skip rate and level); and other fixed
permutations of all the features (random ones, and the features reversed), to see how much of a
ranking a gate reading the wrong features keeps by chance. `--banks` runs only the banks named.

`layerwatch calibrate` sets the floors in layerwatch/alerts/profiles/demo.yaml from the same gauges on its own
baseline (docs/alerting.md, "What calibrate measures"); this script cross-checks them on the load
generator's traffic (docs/service.md, "Layer signals").
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import cast

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from layerwatch.demo.loadgen import PROMPTS
from layerwatch.gate_importance import LayerSignalStats, spearman
from layerwatch.inference_shim.runtime.agreement import ShadowJob, full_depth_agreement
from layerwatch.inference_shim.runtime.checkpoint import LoadedCheckpoint, load_checkpoint
from layerwatch.inference_shim.runtime.demo_model import DEMO_MODEL_DIR
from layerwatch.inference_shim.runtime.engine import GenerationEngine, SamplingParams
from layerwatch.inference_shim.runtime.gates import (
    GATES_FILE,
    LoadedGates,
    feature_permutation,
    gates_sha256,
    load_gates,
    scramble_gates,
    shuffle_gates,
)
from layerwatch.inference_shim.runtime.model import Block, GateBank
from layerwatch.statistics import check_bimodality

POOLED_PAIRS = 4096  # the previous statistic's reservoir of (token, layer) pairs
VERDICT_WINDOW = 5000  # decode-time entropies per bimodality verdict


def measure(loaded: LoadedCheckpoint, gates: LoadedGates, requests: int, max_tokens: int, temperatures) -> dict:
    model, tokenizer = loaded.model, loaded.tokenizer
    model.attach_gates(gates.gates)
    steps: list[tuple[np.ndarray, np.ndarray]] = []
    engine = GenerationEngine(
        model,
        tokenizer,
        model_name="bench",
        policy=gates.metadata.policy(),
        step_hook=lambda step: steps.append((step.entropies, step.skipped)),
    )
    stats = LayerSignalStats(model.config.num_layers)
    pooled_gates: list[np.ndarray] = []
    pooled_updates: list[np.ndarray] = []
    readings: dict[str, list] = {"pooled": [], "within": [], "between": [], "layers": []}
    probed_s, plain_s, greedy_tokens, agreements = [], [], 0, 0
    for i in range(requests):
        prompt = tokenizer.encode(PROMPTS[i % len(PROMPTS)])
        temperature = temperatures[i % len(temperatures)]
        params = SamplingParams(max_tokens=max_tokens, temperature=temperature, seed=i)
        generated = engine.generate(prompt, params, record=True)
        assert generated.gated_record is not None  # record=True
        job = ShadowJob(prompt, generated.token_ids, generated.gated_record)
        started = time.perf_counter()
        result = full_depth_agreement(model, job, layer_signals=True)
        probed_s.append(time.perf_counter() - started)
        started = time.perf_counter()
        full_depth_agreement(model, job)
        plain_s.append(time.perf_counter() - started)
        signals = result.layer_signals
        if signals is None or signals.gate_score is None:
            raise RuntimeError("full_depth_agreement(..., layer_signals=True) returned no gate scores")
        stats.observe(signals)
        if temperature == 0:
            greedy_tokens, agreements = greedy_tokens + result.tokens, agreements + result.agreements
        pooled_gates.append(signals.gate_score.ravel())
        pooled_updates.append(signals.relative_update.ravel())
        g, u = np.concatenate(pooled_gates)[-POOLED_PAIRS:], np.concatenate(pooled_updates)[-POOLED_PAIRS:]
        pooled_gates, pooled_updates = [g], [u]
        if len(g) == POOLED_PAIRS:
            readings["pooled"].append(spearman(g, u))
        s = stats.snapshot()
        if s.correlation is not None:
            readings["within"].append(s.correlation)
            readings["between"].append(s.layer_order_correlation)
            readings["layers"].append(s.layer_correlation)
    entropies = np.concatenate([e for e, _ in steps]).ravel()
    verdicts = [
        check_bimodality(entropies[i : i + VERDICT_WINDOW], 1000)
        for i in range(0, len(entropies) - VERDICT_WINDOW + 1, VERDICT_WINDOW)
    ]
    return readings | {
        "skip_ratio": float(np.concatenate([s for _, s in steps]).mean()),
        "verdicts": verdicts,
        "agreement": agreements / greedy_tokens if greedy_tokens else None,
        "probed_ms": 1000 * statistics.median(probed_s),
        "plain_ms": 1000 * statistics.median(plain_s),
        "counted_layers": stats.snapshot().counted_layers,
    }


def permuted(gates: LoadedGates, source: list[int], bias_shift: Callable[[int, torch.Tensor], torch.Tensor] | None):
    """Gates whose first projection reads feature j from `source[j]`; `bias_shift(layer, new weight)`
    is added to the first biases (None: the same biases)."""
    bank = GateBank(gates.metadata.num_layers, gates.metadata.hidden_size)
    inverse = torch.argsort(torch.tensor(source))
    with torch.no_grad():
        for layer, gate in enumerate(bank.gates):
            weights = {name: t.detach().float().cpu().clone() for name, t in gates.gates[layer].state_dict().items()}
            moved = weights["fc1.weight"][:, inverse]
            if bias_shift is not None:
                weights["fc1.bias"] += bias_shift(layer, moved)
            weights["fc1.weight"] = moved
            gate.load_state_dict(weights)
    bank = bank.eval()
    return LoadedGates(bank, gates.metadata, gates_sha256(bank, gates.metadata))


def healthy_input_means(loaded: LoadedCheckpoint) -> list[torch.Tensor]:
    """Each layer's mean normed input (what its gate reads) over the load generator's prompts at full depth."""
    model, tokenizer = loaded.model, loaded.tokenizer
    inputs: list[list[torch.Tensor]] = [[] for _ in range(model.config.num_layers)]
    with torch.no_grad():
        for prompt in PROMPTS:
            tokens = torch.tensor([tokenizer.encode(prompt + " and the LORD spake unto Moses, saying,")])
            h = model.embed(tokens)
            cos, sin = model.rope(torch.arange(tokens.shape[1])[None], h.dtype)
            for layer, block in enumerate(cast("Iterable[Block]", model.layers)):  # a ModuleList is not generic
                x = block.input_layernorm(h)
                inputs[layer].append(x[0].float())
                h, _, _ = block(h, x, cos, sin, None)
    return [torch.cat(x).mean(dim=0) for x in inputs]


def exploration_banks(loaded: LoadedCheckpoint, served: LoadedGates) -> dict[str, LoadedGates]:
    d = served.metadata.hidden_size
    banks = {}
    for k in (16, 48, 64):
        chosen = np.random.default_rng(0).choice(d, k, replace=False)
        source = list(range(d))
        for j, s in zip(chosen, np.roll(chosen, 1)):  # a cycle through k features: none stays
            source[int(j)] = int(s)
        banks[f"{k} of {d} features cycled"] = permuted(served, source, None)
    means = healthy_input_means(loaded)
    old = [served.gates[layer].fc1.weight.detach().float().cpu() for layer in range(served.metadata.num_layers)]
    banks["--scramble-gates with mean pre-activations kept"] = permuted(
        served, feature_permutation(d), lambda layer, moved: (old[layer] - moved) @ means[layer]
    )
    for seed in range(3):
        source = np.random.default_rng(seed).permutation(d).tolist()
        banks[f"random feature permutation (seed {seed})"] = permuted(served, source, None)
    banks["features reversed"] = permuted(served, list(range(d - 1, -1, -1)), None)
    return banks


def span(values) -> str:
    v = np.array([x for x in values if x is not None], dtype=float)
    return f"{v.min():.3f} to {v.max():.3f} (median {np.median(v):.3f})" if v.size else "absent"


def main() -> int:
    parser = argparse.ArgumentParser(
        allow_abbrev=False, description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", type=Path, default=DEMO_MODEL_DIR, help="checkpoint folder with its gate file")
    parser.add_argument("--requests", type=int, default=96, help="shadow-checked requests per gate bank")
    parser.add_argument("--max-tokens", type=int, default=24, help="tokens per request (the end-to-end load's)")
    parser.add_argument("--temperatures", default="0,1.0,0.7", help="sampling temperatures, cycled (0: greedy)")
    parser.add_argument("--explore", action="store_true", help="also the permutations that are not drills")
    parser.add_argument("--banks", default="", help="only these gate banks (comma-separated names as printed)")
    parser.add_argument("--threads", type=int, default=1, help="torch threads")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    temperatures = [float(t) for t in args.temperatures.split(",")]
    loaded = load_checkpoint(args.model)
    served = load_gates(args.model / GATES_FILE, loaded.model)
    banks = {"served": served, "--shuffle-gates": shuffle_gates(served), "--scramble-gates": scramble_gates(served)}
    if args.explore:
        banks |= exploration_banks(loaded, served)
    if args.banks:
        wanted = args.banks.split(",")
        unknown = sorted(set(wanted) - set(banks))
        if unknown:
            parser.error(f"unknown gate bank(s) {unknown}; known: {sorted(banks)}")
        banks = {name: gates for name, gates in banks.items() if name in wanted}
    print(
        f"{args.model.name}: {args.requests} requests of {args.max_tokens} tokens per gate bank, temperatures "
        f"{temperatures}, gates {served.sha256[:12]}"
    )
    for name, gates in banks.items():
        r = measure(loaded, gates, args.requests, args.max_tokens, temperatures)
        bimodal = sum(v.bimodal for v in r["verdicts"])
        peaks = sorted({v.peaks for v in r["verdicts"]})
        agreement = "n/a" if r["agreement"] is None else f"{r['agreement']:.3f}"
        print(f"\n{name} ({gates.sha256[:12]}):")
        print(f"  pooled (token, layer) correlation, the previous statistic: {span(r['pooled'])}")
        print(f"  within layers (the headline, {r['counted_layers']} layers): {span(r['within'])}")
        print(f"  between layers: {span(r['between'])}")
        if r["layers"]:
            layers = np.array(r["layers"])  # [readings, L], NaN where a layer was not measured
            spans = [
                f"{layer}:{column[np.isfinite(column)].min():.2f}..{column[np.isfinite(column)].max():.2f}"
                for layer, column in enumerate(layers.T)
                if np.isfinite(column).any()
            ]
            print("  per layer (min..max): " + " ".join(spans))
        print(
            f"  skip ratio {r['skip_ratio']:.3f}; bimodal in {bimodal}/{len(r['verdicts'])} windows of "
            f"{VERDICT_WINDOW} entropies (peaks {peaks}); shadow agreement (greedy requests) {agreement}"
        )
        print(f"  shadow pass: {r['probed_ms']:.1f} ms with the probe, {r['plain_ms']:.1f} ms without (median)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
