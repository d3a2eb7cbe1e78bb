"""Per-request skipping on the demo model: the healthy tail, and a small category that runs away.

    .venv/bin/python benchmarks/request_tail.py                      # 1,000 healthy, then the mix
    .venv/bin/python benchmarks/request_tail.py --requests 400 --category-share 0.05

Starts `layerwatch serve` (the embedded demo model) on loopback and sends, with layerwatch.demo.loadgen:
1. `--requests` requests of the load generator's healthy traffic (its prompts, 32 tokens, a quarter
   greedy): the per-request skip fractions this traffic shows, and the share above each bucket edge.
   This checks `request_tail` of layerwatch/alerts/profiles/demo.yaml, which `layerwatch calibrate` measures
   from its baseline's requests, against served traffic (docs/alerting.md, "What calibrate measures");
2. as many again with `--category-share` of them from layerwatch.demo.loadgen.STUTTER (garbled transcripts at
   temperature 0, 64 tokens): the global skip ratio against the share of requests above the runaway
   cut-off, and the layers the runaway requests skip (layerwatch_request_runaway_layer_skips_total).

Everything is read from the shim's /metrics (the histograms and counters the alerts read), as a
difference between two scrapes. Prints the numbers; exits 1 if the category does not show in the
tail (no runaway request in phase 2) or the healthy traffic already does (phase 1 above the cut-off
more often than the profile's normal share).
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from layerwatch.alerts.profile_file import PROFILES_DIR, load_profiles
from layerwatch.catalog import REQUEST_FRACTION_BUCKETS
from layerwatch.demo.loadgen import STUTTER, Category, run_load
from layerwatch.demo.processes import ManagedProcess, free_port
from layerwatch.inference_shim.runtime.demo_model import DEMO_MODEL_DIR, DEMO_MODEL_NAME
from tests.support import sample_sum, scrape

LAYERWATCH = [sys.executable, "-m", "layerwatch.cli.main"]


def delta(after: dict, before: dict, name: str, **labels: str) -> float:
    return sample_sum(after, name, **labels) - sample_sum(before, name, **labels)


def summary(after: dict, before: dict, cutoff: float, layers: int) -> dict:
    count = delta(after, before, "layerwatch_request_skip_fraction_count")
    above = {
        edge: 1 - delta(after, before, "layerwatch_request_skip_fraction_bucket", le=str(edge)) / count
        for edge in REQUEST_FRACTION_BUCKETS
    }
    runaway_tokens = delta(after, before, "layerwatch_request_runaway_tokens_total")
    per_layer = [
        delta(after, before, "layerwatch_request_runaway_layer_skips_total", layer=str(layer))
        for layer in range(layers)
    ]
    overall = [
        delta(after, before, "layerwatch_layer_skips_total", layer=str(layer))
        / delta(after, before, "layerwatch_layer_evaluations_total", layer=str(layer))
        for layer in range(layers)
    ]
    return {
        "requests": count,
        "skip_ratio": sum(
            delta(after, before, "layerwatch_layer_skips_total", layer=str(layer)) for layer in range(layers)
        )
        / sum(delta(after, before, "layerwatch_layer_evaluations_total", layer=str(layer)) for layer in range(layers)),
        "mean_request_skip_fraction": delta(after, before, "layerwatch_request_skip_fraction_sum") / count,
        "above": above,
        "tail_share": above[cutoff],
        "runaway_requests": round(above[cutoff] * count),
        "runaway_layer_ratio": [s / runaway_tokens if runaway_tokens else 0.0 for s in per_layer],
        "overall_layer_ratio": overall,
    }


def report(title: str, s: dict, cutoff: float) -> None:
    print(f"\n{title}: {s['requests']:.0f} requests")
    print(
        f"  global skip ratio {s['skip_ratio']:.4f}; "
        f"mean per-request skip fraction {s['mean_request_skip_fraction']:.4f}"
    )
    print(
        "  share of requests above:  " + "  ".join(f"{e:g}: {v:.3f}" for e, v in s["above"].items() if 0.2 <= e <= 0.5)
    )
    print(f"  above the runaway cut-off {cutoff:g}: {s['tail_share']:.4f} ({s['runaway_requests']} requests)")
    if s["runaway_requests"]:
        ranked = sorted(
            range(len(s["runaway_layer_ratio"])),
            key=lambda l: s["runaway_layer_ratio"][l] - s["overall_layer_ratio"][l],
            reverse=True,
        )
        print(
            "  runaway requests' per-layer skip ratio (vs all traffic), most above first: "
            + ", ".join(
                f"{l}: {s['runaway_layer_ratio'][l]:.2f} ({s['overall_layer_ratio'][l]:.2f})" for l in ranked[:5]
            )
        )


def main() -> int:
    parser = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=1000, help="requests per phase")
    parser.add_argument("--concurrency", type=int, default=4)
    parser.add_argument("--category-share", type=float, default=STUTTER.share)
    args = parser.parse_args()
    if not (DEMO_MODEL_DIR / "config.json").is_file():
        parser.error(f"the demo model is missing: {DEMO_MODEL_DIR}")
    (profile,) = [p for p in load_profiles(PROFILES_DIR) if p.model_name == DEMO_MODEL_NAME]
    cutoff, normal_share = profile.request_tail.runaway_skip_fraction, profile.request_tail.normal_share
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    with tempfile.TemporaryDirectory() as tmp:
        shim = ManagedProcess(
            "shim",
            [*LAYERWATCH, "serve", "--port", str(port), "--exporter-address", "", "--log-level", "warning"],
            Path(tmp) / "shim.log",
        )
        try:
            shim.wait_http(f"{url}/readyz", timeout=120)
            layers = int(next(dict(ls)["layers"] for (n, ls), _ in scrape(url).items() if n == "layerwatch_model_info"))
            print(f"demo model, runaway cut-off {cutoff:g} (profile), normal share {normal_share:g}")
            start = scrape(url)
            healthy = run_load(
                url, DEMO_MODEL_NAME, duration=3600, concurrency=args.concurrency, max_requests=args.requests
            )
            middle = scrape(url)
            category = Category(STUTTER.prompts, args.category_share, STUTTER.max_tokens, STUTTER.greedy)
            mixed = run_load(
                url,
                DEMO_MODEL_NAME,
                duration=3600,
                concurrency=args.concurrency,
                max_requests=args.requests,
                seed=1,
                category=category,
            )
            end = scrape(url)
        finally:
            shim.stop()
    h, m = summary(middle, start, cutoff, layers), summary(end, middle, cutoff, layers)
    report("1. healthy load (layerwatch.demo.loadgen)", h, cutoff)
    print(f"  load: {healthy.summary()}")
    report(
        f"2. the same load with {args.category_share:.0%} garbled transcripts (layerwatch.demo.loadgen.STUTTER)",
        m,
        cutoff,
    )
    print(f"  load: {mixed.summary()}")
    if mixed.category_requests:
        executed, skipped = mixed.category_layers_executed, mixed.category_layers_skipped
        print(f"  the category: {mixed.category_requests} requests, skip fraction {skipped / (executed + skipped):.4f}")
    print(
        f"\nglobal skip ratio {h['skip_ratio']:.4f} -> {m['skip_ratio']:.4f} "
        f"({m['skip_ratio'] - h['skip_ratio']:+.4f}); share above {cutoff:g}: "
        f"{h['tail_share']:.4f} -> {m['tail_share']:.4f} (alert above {normal_share:g})"
    )
    ok = h["tail_share"] <= normal_share and m["tail_share"] > normal_share
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
