"""Over-long prompts against a short request: does refusing them cost everyone else?

    .venv/bin/python benchmarks/prompt_flood.py                        # the embedded demo model
    .venv/bin/python benchmarks/prompt_flood.py --model DIR --duration 20 --flooders 8

Starts `layerwatch serve` (body cap raised so that the prompts reach the prompt check), measures
the latency of a short completion (an 8-token prompt, 8 generated tokens) alone, then while
`--flooders` clients post `--prompt-bytes` prompts back to back for `--duration` seconds. Prints
the short request's latencies and what the flooders got. Results: docs/reliability.md.
"""

from __future__ import annotations

import argparse
import collections
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from layerwatch.demo.processes import LAYERWATCH_COMMAND, ManagedProcess, free_port
from layerwatch.inference_shim.runtime.demo_model import DEMO_MODEL_DIR, DEMO_MODEL_NAME

SHORT_PROMPT = "In the beginning God created the heaven"


def main() -> int:
    parser = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.splitlines()[0])
    parser.add_argument("--model", type=Path, default=None, help="checkpoint folder (default: the demo model)")
    parser.add_argument("--duration", type=float, default=20.0)
    parser.add_argument("--flooders", type=int, default=8)
    parser.add_argument("--prompt-bytes", type=int, default=1 << 20)
    args = parser.parse_args()
    model_dir = args.model or DEMO_MODEL_DIR
    model_name = model_dir.resolve().name if args.model else DEMO_MODEL_NAME

    work = Path(tempfile.mkdtemp(prefix="layerwatch-flood-"))
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    argv = [*LAYERWATCH_COMMAND, "serve", "--model", str(model_dir), "--model-name", model_name]
    argv += ["--port", str(port), "--exporter-address", "", "--log-level", "warning"]
    argv += ["--max-body-bytes", str(args.prompt_bytes + (64 << 10))]
    shim = ManagedProcess("serve", argv, work / "serve.log")
    try:
        shim.wait_http(f"{url}/healthz", timeout=180)
        with httpx.Client(timeout=300) as client:

            def short_request() -> float:
                started = time.monotonic()
                body = {"model": model_name, "prompt": SHORT_PROMPT, "max_tokens": 8}
                client.post(f"{url}/v1/completions", json=body).raise_for_status()
                return time.monotonic() - started

            short_request()  # warm-up
            alone = [short_request() for _ in range(10)]
            flood_prompt = ("The quick brown fox jumps over the lazy dog. " * (args.prompt_bytes // 45 + 1))[
                : args.prompt_bytes
            ]
            outcomes: collections.Counter[str] = collections.Counter()
            stop = threading.Event()

            def flood() -> None:
                with httpx.Client(timeout=120) as own:
                    while not stop.is_set():
                        body = {"model": model_name, "prompt": flood_prompt, "max_tokens": 8}
                        try:
                            response = own.post(f"{url}/v1/completions", json=body)
                        except httpx.HTTPError as exc:
                            outcomes[type(exc).__name__] += 1
                            continue
                        code = response.json().get("error", {}).get("code") if response.status_code >= 400 else ""
                        outcomes[f"{response.status_code} {code}".strip()] += 1

            flooders = [threading.Thread(target=flood, daemon=True) for _ in range(args.flooders)]
            for thread in flooders:
                thread.start()
            time.sleep(1.0)  # the flood is on
            deadline = time.monotonic() + args.duration
            during = []
            while time.monotonic() < deadline:
                during.append(short_request())
            stop.set()
            for thread in flooders:
                thread.join()
    finally:
        shim.stop()

    def summary(latencies: list[float]) -> str:
        return (
            f"n={len(latencies)} median {statistics.median(latencies) * 1000:.0f} ms, "
            f"max {max(latencies) * 1000:.0f} ms"
        )

    print(f"short request alone:        {summary(alone)}")
    print(f"short request during flood: {summary(during)}")
    print(f"flood requests ({args.flooders} clients x {args.prompt_bytes} bytes): {dict(outcomes)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
