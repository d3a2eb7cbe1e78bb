"""Fleet simulation: N synthetic shims into one real exporter, and the series a model costs Prometheus.

    .venv/bin/python benchmarks/fleet_simulation.py [--shims 1,8,32,64,128] [--layers 80] [--rows 64]
                                                    [--steps-per-second 30] [--seconds 5]

Part 1 starts a fresh `layerwatch exporter` process for each N and sends it the frames of N shims,
each decoding --rows sequences of a --layers model at --steps-per-second (one frame per decode step,
its own shim id and sequence numbers), for --seconds. It reports what the exporter received and
counted lost, its CPU share, resident memory, /metrics size and scrape time: where one exporter stops
keeping up. Part 2 counts the series of one model on both pages, the shim's (a real `layerwatch
serve` of a random --layers model) and the exporter's, with and without --per-layer.
docs/scaling.md turns both into the cost per GPU and per 1,000 GPUs.
"""

from __future__ import annotations

import argparse
import json
import re
import socket
import struct
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from layerwatch.demo.processes import LAYERWATCH_COMMAND, free_port
from layerwatch.wire import GateFrame, encode_frame
from tests.support import page_samples, sample_sum

MODEL_NAME = "fleet-sim"
THRESHOLD = 0.18
VARIANTS = 8  # distinct payloads per shim, cycled (only the sequence number changes between sends)
_SEQUENCE = struct.Struct("<Q")
SEQUENCE_OFFSET = 10  # docs/wire-format.md: the u64 sequence follows magic, version, flags, rows, layers


def start_exporter(*extra: str) -> tuple[subprocess.Popen, int, int]:
    """A real exporter on loopback; returns the process, its UDP port and its HTTP port."""
    process = subprocess.Popen(
        [*LAYERWATCH_COMMAND, "exporter", "--listen", "127.0.0.1:0", "--http", "127.0.0.1:0", *extra],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    assert process.stderr is not None  # a pipe: stderr=PIPE
    line = process.stderr.readline()
    found = re.search(r"udp://[\d.]+:(\d+), serving http://[\d.]+:(\d+)", line)
    if found is None:
        process.kill()
        raise RuntimeError(f"exporter did not start: {line}{process.stderr.read()}")
    return process, int(found[1]), int(found[2])


def scrape(url: str) -> tuple[str, float]:
    started = time.perf_counter()
    page = urllib.request.urlopen(url, timeout=30).read().decode()
    return page, time.perf_counter() - started


def page_sum(page: str, name: str) -> float:
    return sample_sum(page_samples(page), name)


def series_count(page: str) -> int:
    return sum(1 for line in page.splitlines() if line and not line.startswith("#"))


def shim_frames(shim: int, rows: int, layers: int) -> list[bytearray]:
    """VARIANTS encoded frames of one shim: two-hump entropies, skipped where below τ."""
    rng = np.random.default_rng(shim)
    frames = []
    for _ in range(VARIANTS):
        low = rng.random((rows, layers)) < 0.3
        entropies = np.clip(np.where(low, rng.normal(0.08, 0.03, low.shape), rng.normal(0.6, 0.1, low.shape)), 0, 1)
        entropies = entropies.astype(np.float32)
        frame = GateFrame(MODEL_NAME, f"sim-{shim}", 0, entropies, entropies < THRESHOLD, THRESHOLD)
        frames.append(bytearray(encode_frame(frame)))
    return frames


def simulate(shims: int, rows: int, layers: int, steps_per_second: float, seconds: float) -> dict:
    """N shims' frames, paced, into a fresh exporter; what it received, lost and cost."""
    process, udp_port, http_port = start_exporter()
    url = f"http://127.0.0.1:{http_port}/metrics"
    try:
        frames = [shim_frames(shim, rows, layers) for shim in range(shims)]
        sender = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        address = ("127.0.0.1", udp_port)
        page, _ = scrape(url)
        cpu_before = page_sum(page, "process_cpu_seconds_total")
        interval = 1.0 / (steps_per_second * shims)  # the fleet's frames, evenly spread
        sent, most_behind = 0, 0
        started = time.perf_counter()
        while (now := time.perf_counter() - started) < seconds:
            due = int(now / interval)
            most_behind = max(most_behind, due - sent)  # frames the sender owes: it catches up in a burst
            while sent < due:
                shim, step = sent % shims, sent // shims
                data = frames[shim][step % VARIANTS]
                _SEQUENCE.pack_into(data, SEQUENCE_OFFSET, step)
                sender.sendto(data, address)
                sent += 1
            time.sleep(min(interval, 0.001))
        wall = time.perf_counter() - started
        time.sleep(1.0)  # let the exporter drain its socket buffer
        page, _ = scrape(url)
        cpu = page_sum(page, "process_cpu_seconds_total") - cpu_before
        scrapes = [scrape(url)[1] for _ in range(5)]
        page, _ = scrape(url)
        received = page_sum(page, "layerwatch_exporter_frames_received_total")
        return {
            "shims": shims,
            "frames_per_second": sent / wall,
            "entropies_per_second": sent * rows * layers / wall,
            "sent": sent,
            "sender_most_behind": most_behind,
            "received": received,
            "lost": page_sum(page, "layerwatch_exporter_frames_lost_total"),
            "exporter_cpu_share": cpu / (wall + 1.0),
            "resident_mb": page_sum(page, "process_resident_memory_bytes") / 1e6,
            "metrics_kib": len(page.encode()) / 1024,
            "scrape_ms": 1000 * float(np.median(scrapes)),
        }
    finally:
        process.terminate()
        process.wait(timeout=10)


def exporter_series(layers: int, per_layer: bool) -> int:
    """Series on the exporter's page for one model with full windows (verdicts present)."""
    process, udp_port, http_port = start_exporter(*(["--per-layer"] if per_layer else []))
    try:
        sender = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        data = shim_frames(0, 8, layers)[0]
        for step in range(400):
            _SEQUENCE.pack_into(data, SEQUENCE_OFFSET, step)
            sender.sendto(data, ("127.0.0.1", udp_port))
            time.sleep(0.0005)
        time.sleep(0.5)
        page, _ = scrape(f"http://127.0.0.1:{http_port}/metrics")
        return series_count(page)
    finally:
        process.terminate()
        process.wait(timeout=10)


def shim_series(layers: int) -> int:
    """Series on a real shim's page serving a random `layers`-layer model, after a few requests."""
    from layerwatch.inference_shim.runtime.checkpoint import save_checkpoint
    from layerwatch.inference_shim.runtime.demo_model import DEMO_MODEL_DIR
    from layerwatch.inference_shim.runtime.model import ModelConfig, Transformer

    demo = json.loads((DEMO_MODEL_DIR / "config.json").read_text())
    config = ModelConfig(
        vocab_size=demo["vocab_size"],
        hidden_size=64,
        intermediate_size=128,
        num_layers=layers,
        num_heads=4,
        num_kv_heads=2,
        head_dim=16,
        bos_token_id=demo["bos_token_id"],
        eos_token_ids=(demo["eos_token_id"],),
    )
    with tempfile.TemporaryDirectory() as folder:
        save_checkpoint(Transformer(config).eval(), DEMO_MODEL_DIR / "tokenizer.json", folder)
        port = free_port()
        process = subprocess.Popen(
            [*LAYERWATCH_COMMAND, "serve", "--model", folder, "--reset-gates", "--port", str(port)]
            + ["--shadow-rate", "1", "--log-level", "warning"],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        try:
            base = f"http://127.0.0.1:{port}"
            deadline = time.monotonic() + 120
            while True:
                try:
                    urllib.request.urlopen(f"{base}/readyz", timeout=5)
                    break
                except OSError:
                    if time.monotonic() > deadline or process.poll() is not None:
                        raise RuntimeError("the shim did not become ready") from None
                    time.sleep(0.5)
            model = json.loads(urllib.request.urlopen(f"{base}/v1/models", timeout=10).read())["data"][0]["id"]
            for temperature in (0.0, 0.8):
                body = json.dumps(
                    {"model": model, "prompt": "In the beginning", "max_tokens": 8, "temperature": temperature}
                )
                request = urllib.request.Request(
                    f"{base}/v1/completions", body.encode(), {"Content-Type": "application/json"}
                )
                urllib.request.urlopen(request, timeout=60).read()
            page, _ = scrape(f"{base}/metrics")
            return series_count(page)
        finally:
            process.terminate()
            process.wait(timeout=30)


def main() -> None:
    parser = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.split("\n\n")[0])
    parser.add_argument("--shims", default="1,8,32,64,128", help="comma-separated fleet sizes N")
    parser.add_argument("--layers", type=int, default=80)
    parser.add_argument("--rows", type=int, default=64, help="sequences decoded per step (batch size)")
    parser.add_argument("--steps-per-second", type=float, default=30.0, help="decode steps per second per shim")
    parser.add_argument("--seconds", type=float, default=5.0)
    args = parser.parse_args()

    print(
        f"N shims -> one exporter: {args.rows} rows x {args.layers} layers per frame, "
        f"{args.steps_per_second:g} frames/s per shim, {args.seconds:g} s"
    )
    print("| shims | frames/s | M entropies/s | received | lost | exporter CPU | RSS MB | /metrics KiB | scrape ms |")
    print("|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for shims in (int(n) for n in args.shims.split(",")):
        r = simulate(shims, args.rows, args.layers, args.steps_per_second, args.seconds)
        late = r["sender_most_behind"] > shims  # more than one round of frames owed at once: bursts
        note = f" (sender up to {r['sender_most_behind']} frames late, sent in bursts)" if late else ""
        print(
            f"| {shims} | {r['frames_per_second']:,.0f} | {r['entropies_per_second'] / 1e6:.2f} | "
            f"{r['received']:,.0f} | {r['lost']:,.0f} ({r['lost'] / max(r['sent'], 1):.1%}) | "
            f"{r['exporter_cpu_share']:.0%} | {r['resident_mb']:.0f} | {r['metrics_kib']:.0f} | "
            f"{r['scrape_ms']:.1f} |{note}"
        )
    print(f"\nseries per model, {args.layers} layers:")
    print(f"  exporter: {exporter_series(args.layers, False)}, with --per-layer {exporter_series(args.layers, True)}")
    print(f"  shim: {shim_series(args.layers)}")


if __name__ == "__main__":
    main()
