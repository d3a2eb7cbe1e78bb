"""Gate-importance correlation of a model, healthy and with --shuffle-gates, as the shim measures it.

    .venv/bin/python benchmarks/gate_signals.py                      # the demo model
    .venv/bin/python benchmarks/gate_signals.py --model DIR --requests 96

What the shim does with `--shadow-rate`, offline: greedy completions of the load generator's prompts
(demo/loadgen.py) by the real GenerationEngine, each re-run at full depth with the layer probe
(`full_depth_agreement(..., layer_signals=True)`) and folded into a `LayerSignalStats`; the value of
`layerwatch_gate_importance_correlation` is recorded after every job once the reservoir is full.
`--temperature` > 0 completes with sampling instead (more varied text; the shim checks requests at
any temperature). Prints, for the served gates and the shuffled ones: the gauge's range, the
shadow agreement, the per-layer means, and the shadow pass's time with and without the probe.
`layerwatch calibrate` sets the floor in alerts/profiles/demo.yaml from the same gauge on its own
baseline (docs/alerting.md, "What calibrate measures"); this script cross-checks it on the load
generator's prompts, and times the probe (docs/service.md, "Layer signals").
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from demo.loadgen import PROMPTS
from inference_shim.runtime.agreement import ShadowJob, full_depth_agreement
from inference_shim.runtime.checkpoint import load_checkpoint
from inference_shim.runtime.demo_model import DEMO_MODEL_DIR
from inference_shim.runtime.engine import GenerationEngine, SamplingParams
from inference_shim.runtime.gates import GATES_FILE, LoadedGates, load_gates, shuffle_gates
from layerwatch.gate_importance import LayerSignalStats


def measure(loaded, gates: LoadedGates, requests: int, max_tokens: int, temperature: float) -> dict:
    model, tokenizer = loaded.model, loaded.tokenizer
    model.attach_gates(gates.gates)
    policy = gates.metadata.policy()
    engine = GenerationEngine(model, tokenizer, model_name="bench", policy=policy)
    stats = LayerSignalStats(model.config.num_layers)
    gauge, probed_s, plain_s, tokens, agreements = [], [], [], 0, 0
    for i in range(requests):
        prompt = tokenizer.encode(PROMPTS[i % len(PROMPTS)])
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
        if result.layer_signals is None:
            raise RuntimeError("full_depth_agreement(..., layer_signals=True) returned no layer signals")
        stats.observe(result.layer_signals)
        tokens, agreements = tokens + result.tokens, agreements + result.agreements
        correlation = stats.snapshot().correlation
        if correlation is not None:
            gauge.append(correlation)
    s = stats.snapshot()
    return {
        "gauge": gauge,
        "agreement": agreements / max(tokens, 1),
        "update": s.relative_update_sum / s.tokens,
        "kl": s.attention_kl_sum / s.tokens,
        "probed_ms": 1000 * statistics.median(probed_s),
        "plain_ms": 1000 * statistics.median(plain_s),
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", type=Path, default=DEMO_MODEL_DIR, help="checkpoint folder with its gate file")
    parser.add_argument("--requests", type=int, default=48, help="shadow-checked requests per gate bank")
    parser.add_argument("--max-tokens", type=int, default=24, help="tokens per request (the end-to-end load's)")
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--threads", type=int, default=1, help="torch threads")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    loaded = load_checkpoint(args.model)
    served = load_gates(args.model / GATES_FILE, loaded.model)
    print(
        f"{args.model.name}: {args.requests} requests of {args.max_tokens} tokens, temperature "
        f"{args.temperature:g}, gates {served.sha256[:12]}"
    )
    for name, gates in (("served", served), ("shuffled", shuffle_gates(served))):
        r = measure(loaded, gates, args.requests, args.max_tokens, args.temperature)
        g = np.array(r["gauge"])
        span = "absent"
        if len(g):
            span = f"min {g.min():.3f} median {np.median(g):.3f} max {g.max():.3f} ({len(g)} values)"
        print(f"\n{name} gates ({gates.sha256[:12]}): correlation {span}; shadow agreement {r['agreement']:.3f}")
        print(f"  mean relative update per layer: {np.array2string(r['update'], precision=3, max_line_width=200)}")
        print(f"  mean attention KL per layer:    {np.array2string(r['kl'], precision=2, max_line_width=200)}")
        print(f"  shadow pass: {r['probed_ms']:.1f} ms with the probe, {r['plain_ms']:.1f} ms without (median)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
