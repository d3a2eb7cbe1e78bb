"""Load test: `layerwatch serve` + `layerwatch exporter` on loopback under concurrent clients.

    .venv/bin/python benchmarks/load_test.py                       # the embedded demo model
    .venv/bin/python benchmarks/load_test.py --model DIR --duration 60 --concurrency 8

Streaming and non-streaming completions from `--concurrency` clients for `--duration` seconds
(layerwatch.demo.loadgen.run_load), then the reconciliation the reliability tests assert
(tests/reliability/test_load.py), on a longer run: zero 5xx; the shim's generated-tokens counter
equals Σ usage.completion_tokens; frames sent equal the exporter's received + lost; the
exporter's entropy count equals decoded tokens × layers. Prints throughput, latency percentiles
and each equality; exits 1 if one does not hold. Results: docs/reliability.md.
"""

from __future__ import annotations

import argparse
import json
import socket
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from layerwatch.demo.loadgen import run_load
from layerwatch.demo.processes import LAYERWATCH_COMMAND, ManagedProcess, free_port
from layerwatch.exporter.live_view import scrape, total
from layerwatch.inference_shim.runtime.demo_model import DEMO_MODEL_DIR

LAYERWATCH = LAYERWATCH_COMMAND


def main() -> int:
    parser = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.splitlines()[0])
    parser.add_argument("--model", type=Path, default=None, help="checkpoint folder (default: the demo model)")
    parser.add_argument("--duration", type=float, default=30.0)
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--max-batch-size", type=int, default=8)
    parser.add_argument("--stream-fraction", type=float, default=0.5)
    args = parser.parse_args()
    if not ((args.model or DEMO_MODEL_DIR) / "config.json").is_file():
        parser.error(
            f"no checkpoint in {args.model or DEMO_MODEL_DIR} (build the demo model with "
            f"`layerwatch train-demo`, or pass --model)"
        )

    work = Path(tempfile.mkdtemp(prefix="layerwatch-load-"))
    udp, http, port = free_port(socket.SOCK_DGRAM), free_port(), free_port()
    exporter = ManagedProcess(
        "exporter",
        [*LAYERWATCH, "exporter", "--listen", f"127.0.0.1:{udp}", "--http", f"127.0.0.1:{http}"],
        work / "exporter.log",
    )
    model_args = ["--model", str(args.model)] if args.model else []  # none: the demo model, under its name
    shim = ManagedProcess(
        "serve",
        [
            *LAYERWATCH,
            "serve",
            *model_args,
            "--port",
            str(port),
            "--exporter-address",
            f"127.0.0.1:{udp}",
            "--log-level",
            "warning",
            "--max-batch-size",
            str(args.max_batch_size),
            "--max-tokens-cap",
            str(args.max_tokens),
        ],
        work / "serve.log",
    )
    shim_url, exporter_url = f"http://127.0.0.1:{port}", f"http://127.0.0.1:{http}"
    try:
        exporter.wait_http(f"{exporter_url}/healthz", timeout=30)
        shim.wait_http(f"{shim_url}/healthz", timeout=180)
        with urllib.request.urlopen(f"{shim_url}/v1/models", timeout=10) as response:
            model_name = json.loads(response.read())["data"][0]["id"]
        report = run_load(
            shim_url,
            model_name,
            duration=args.duration,
            concurrency=args.concurrency,
            max_tokens=args.max_tokens,
            stream_fraction=args.stream_fraction,
        )
        time.sleep(1.0)  # the last frames in flight
        shim_samples, exporter_samples = scrape(shim_url, timeout=10), scrape(exporter_url, timeout=10)
    finally:
        shim.stop()
        exporter.stop()

    [layers] = {int(labels["layers"]) for labels, _ in shim_samples["layerwatch_model_info"]}
    sent = total(shim_samples, "layerwatch_telemetry_frames_sent_total")
    received = total(exporter_samples, "layerwatch_exporter_frames_received_total")
    lost = total(exporter_samples, "layerwatch_exporter_frames_lost_total")
    checks = {
        "zero 5xx and connection errors": report.server_errors == 0,
        "tokens_total{decode} == Σ usage.completion_tokens": total(
            shim_samples, "layerwatch_tokens_total", phase="decode"
        )
        == report.completion_tokens,
        "requests_total{ok} == requests": total(shim_samples, "layerwatch_requests_total", status="ok")
        == report.requests,
        "frames sent == exporter received + lost": sent == received + lost,
        "exporter entropy count == tokens × layers": total(
            exporter_samples, "layerwatch_entropy_count", model_name=model_name
        )
        == report.completion_tokens * layers,
    }
    print(
        f"model {model_name} ({layers} layers), {args.concurrency} clients, max_tokens {args.max_tokens}, "
        f"batch {args.max_batch_size}, {args.duration:.0f} s"
    )
    print(
        f"requests {report.requests} ({report.requests / report.elapsed:.1f}/s), statuses "
        f"{dict(sorted(report.by_status.items()))}"
    )
    print(f"tokens {report.completion_tokens} ({report.completion_tokens / report.elapsed:.0f} tokens/s)")
    print(
        f"latency p50 {report.percentile(0.5) * 1e3:.0f} ms, p90 {report.percentile(0.9) * 1e3:.0f} ms, "
        f"p99 {report.percentile(0.99) * 1e3:.0f} ms, max {max(report.latencies, default=0) * 1e3:.0f} ms"
    )
    print(
        f"frames sent {sent:.0f}, received {received:.0f}, lost {lost:.0f}, dropped "
        f"{total(shim_samples, 'layerwatch_telemetry_frames_dropped_total'):.0f}"
    )
    for name, held in checks.items():
        print(f"{'held  ' if held else 'BROKEN'} {name}")
    return 0 if all(checks.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
