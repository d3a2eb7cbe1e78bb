"""What h11 (the bounded parser `serve` uses) costs against httptools (uvicorn's default), paired.

    PYTHONPATH=$PWD .venv/bin/python benchmarks/http_parser_cost.py [--checkout /path/to/old/checkout]

Two `serve` processes on the embedded demo model: this checkout (h11, http_protocol.py) and
`--checkout` (default: this one too; give an older one to compare, e.g. one that served with httptools).
In interleaved rounds, alternating which goes first, the same client load goes to each: GET /healthz
on a keep-alive connection, and streamed completions (`stream: true`, sampled, 32 tokens: a
server-sent event per token, each framed by the parser). Printed per server: the median over
rounds of the client's time per request, and the server's CPU time per request (/proc: what the
request cost the process, whatever else the machine runs). Figures in docs/service.md ("Connections").
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from layerwatch.demo.processes import free_port

REPOSITORY = Path(__file__).resolve().parents[1]


def cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def start(checkout: Path, log: Path) -> tuple[subprocess.Popen, str]:
    port = free_port()
    environment = dict(os.environ, PYTHONPATH=str(checkout), OMP_NUM_THREADS="1")
    argv = [sys.executable, "-m", "layerwatch.cli.main", "serve", "--port", str(port), "--exporter-address", ""]
    with open(log, "wb") as output:
        process = subprocess.Popen([*argv, "--log-level", "warning"], cwd=checkout, env=environment, stdout=output)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 180
    while True:
        try:
            httpx.get(f"{url}/healthz", timeout=2)
            return process, url
        except httpx.HTTPError:
            if process.poll() is not None or time.monotonic() > deadline:
                sys.exit(f"serve did not start:\n{log.read_text()[-2000:]}")
            time.sleep(0.3)


def healthz(client: httpx.Client, url: str, count: int) -> None:
    for _ in range(count):
        client.get(f"{url}/healthz").raise_for_status()


def streams(client: httpx.Client, url: str, count: int) -> None:
    body = {"model": "layerwatch-demo", "prompt": "And God said", "max_tokens": 32, "temperature": 0.8, "stream": True}
    for _ in range(count):
        with client.stream("POST", f"{url}/v1/completions", json=body) as response:
            response.raise_for_status()
            for _ in response.iter_lines():
                pass


def timed(process: subprocess.Popen, work, *args) -> tuple[float, float]:
    cpu, wall = cpu_seconds(process.pid), time.perf_counter()
    work(*args)
    return time.perf_counter() - wall, cpu_seconds(process.pid) - cpu


def main() -> None:
    parser = argparse.ArgumentParser(
        allow_abbrev=False, description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--checkout", type=Path, default=REPOSITORY, help="the other server's code")
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--healthz", type=int, default=400, help="GET /healthz per round")
    parser.add_argument("--streams", type=int, default=8, help="streamed completions per round")
    args = parser.parse_args()
    work = Path(os.environ.get("TMPDIR", "/tmp"))
    servers = {"this checkout": start(REPOSITORY, work / "parser-cost-this.log")}
    servers["--checkout"] = start(args.checkout.resolve(), work / "parser-cost-other.log")
    results: dict[str, dict[str, list[float]]] = {name: {} for name in servers}
    try:
        with httpx.Client(timeout=60) as client:
            for _, url in servers.values():  # warm-up: first requests, first compiled paths
                healthz(client, url, 50)
                streams(client, url, 2)
            for round_number in range(args.rounds):
                order = list(servers) if round_number % 2 == 0 else list(reversed(servers))
                for name in order:
                    process, url = servers[name]
                    for kind, load, count in (("healthz", healthz, args.healthz), ("stream", streams, args.streams)):
                        wall, cpu = timed(process, load, client, url, count)
                        results[name].setdefault(f"{kind} wall ms", []).append(1000 * wall / count)
                        results[name].setdefault(f"{kind} server CPU ms", []).append(1000 * cpu / count)
    finally:
        for process, _ in servers.values():
            process.terminate()
            process.wait(60)
    for name, figures in results.items():
        summary = {key: round(statistics.median(values), 3) for key, values in figures.items()}
        print(json.dumps({"server": name, "per request (median over rounds)": summary}))


if __name__ == "__main__":
    main()
