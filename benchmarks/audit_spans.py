"""What the audit trail costs the request path, and how fast its spans leave.

    .venv/bin/python benchmarks/audit_spans.py                    # 2,000 requests, 80 layers, 2 choices
    .venv/bin/python benchmarks/audit_spans.py --layers 16 --requests 5000

Drives the real AuditTrail (layerwatch/inference_shim/service/audit.py) with the real OTLP/HTTP exporter
into an OTLP receiver stand-in in another process (it reads each request and answers 200, as a
collector that accepts everything does), exactly as `layerwatch serve --otlp-endpoint` does per
request: start the span at arrival, end it with a RequestRecord (`--choices` choices of `--tokens`
generated tokens each, per-layer counts over `--layers` layers). Prints the time the request path
spends on it (start + end per request: wall median and p99, and the calling thread's CPU time) and
the export rate (spans the receiver
accepted per second, from the first span ended until the last is exported), and checks that every
span was exported. With spans off nothing runs at all (`ShimService.audit` is None). Results:
docs/performance.md, "Audit spans".
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from layerwatch.inference_shim.runtime.engine import LayerCounts, SamplingParams
from layerwatch.inference_shim.service.audit import AuditTrail
from layerwatch.inference_shim.service.metrics import AuditSpanCounts
from layerwatch.inference_shim.service.records import RequestRecord

# The collector stand-in: an OTLP/HTTP endpoint that reads every export and accepts it.
RECEIVER = """
import http.server, sys
class H(http.server.BaseHTTPRequestHandler):
    def do_POST(self):
        self.rfile.read(int(self.headers["content-length"]))
        self.send_response(200); self.send_header("content-length", "0"); self.end_headers()
    def log_message(self, *a): pass
s = http.server.ThreadingHTTPServer(("127.0.0.1", 0), H)
print(s.server_address[1], flush=True)
s.serve_forever()
"""


def record(layers: int, choices: int, tokens: int, rng: np.random.Generator) -> RequestRecord:
    counts = [
        LayerCounts(
            tokens=tokens,
            skipped=rng.integers(0, tokens, layers),
            below_threshold=rng.integers(0, tokens, layers),
            score_sum=rng.random(layers) * tokens,
            fallbacks=0,
        )
        for _ in range(choices)
    ]
    skipped = int(sum(c.skipped.sum() for c in counts))
    return RequestRecord(
        kind="chat",
        request_id="chatcmpl-0123456789abcdef01234567",
        model_name="bench",
        gates_sha256="0" * 64,
        params=SamplingParams(max_tokens=tokens, temperature=0.7, seed=1),
        n=choices,
        stream=True,
        threshold=0.18,
        depth_mode="gated",  # at the served tau, the reason most requests run there
        depth_reason="default",
        status="ok",
        finish_reasons=["length"] * choices,
        usage={
            "prompt_tokens": 40,
            "completion_tokens": choices * tokens,
            "layers_executed": choices * tokens * layers - skipped,
            "layers_skipped": skipped,
        },
        layers=counts,
    )


def main() -> int:
    parser = argparse.ArgumentParser(
        allow_abbrev=False, description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--requests", type=int, default=2000)
    parser.add_argument("--layers", type=int, default=80, help="layers of the model (80: a 70B Llama)")
    parser.add_argument("--choices", type=int, default=2)
    parser.add_argument("--tokens", type=int, default=256, help="generated tokens per choice")
    args = parser.parse_args()

    receiver = subprocess.Popen([sys.executable, "-c", RECEIVER], stdout=subprocess.PIPE, text=True)
    try:
        assert receiver.stdout is not None
        port = int(receiver.stdout.readline())
        counts = AuditSpanCounts()
        audit = AuditTrail.over_otlp(f"http://127.0.0.1:{port}/v1/traces", counts, "bench-shim")
        rng = np.random.default_rng(0)
        records = [record(args.layers, args.choices, args.tokens, rng) for _ in range(16)]
        costs, cpu = [], []
        first = time.perf_counter()
        for i in range(args.requests):
            started, started_cpu = time.perf_counter(), time.thread_time()
            span = audit.start("chat", "bench", time.monotonic(), {})
            span.end(records[i % len(records)])
            costs.append(time.perf_counter() - started)
            cpu.append(time.thread_time() - started_cpu)
        audit.force_flush()
        elapsed = time.perf_counter() - first
        audit.shutdown()
    finally:
        receiver.kill()
    costs_us = sorted(c * 1e6 for c in costs)
    print(f"{args.requests} requests, {args.layers} layers, {args.choices} choices of {args.tokens} tokens")
    # Wall time includes waiting for the GIL (the export thread encodes in Python) and preemption on a
    # busy machine; the thread's CPU time is what the span itself costs.
    print(
        f"request path (span start + end): wall median {statistics.median(costs_us):.0f} us, "
        f"p99 {costs_us[int(0.99 * len(costs_us))]:.0f} us; "
        f"CPU median {statistics.median(cpu) * 1e6:.0f} us"
    )
    print(f"exported {counts.exported} spans, failed {counts.failed}, dropped {counts.dropped}")
    print(f"export rate: {counts.exported / elapsed:.0f} spans/s (end of the first span to the last export)")
    return 0 if counts.exported == args.requests else 1


if __name__ == "__main__":
    raise SystemExit(main())
