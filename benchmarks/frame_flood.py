"""Forged-frame flood against a real `layerwatch exporter`: its memory, /metrics size and scrape time.

    .venv/bin/python benchmarks/frame_flood.py                           # this checkout, default flags
    .venv/bin/python benchmarks/frame_flood.py --checkout /old/checkout  # an older exporter, same flood
    .venv/bin/python benchmarks/frame_flood.py --with-key                # the exporter has a frame key
    .venv/bin/python benchmarks/frame_flood.py --layers 256 [-- --per-layer]  # the widest frames admitted
    .venv/bin/python benchmarks/frame_flood.py --layers 256 --slow-readers 300   # then scrapes under attack
    .venv/bin/python benchmarks/frame_flood.py --layers 256 --get-flood 16       # ... or under a GET flood

The flood: `--models` well-formed, untagged datagrams over loopback UDP, each naming a
new model and carrying one row of `--layers` layers (15,742 is the widest single-row frame that fits a
datagram). Measured from outside the process: resident memory (/proc) before and after, the size of
one /metrics page and how long it takes. Goals (docs/reliability.md): RSS <= 100 MB, /metrics <= 1 MB,
a scrape <= 100 ms. Figures go into docs/reliability.md ("Forged frames").

With `--slow-readers N` (N connections that ask for /metrics and never read, their receive buffer the
smallest the kernel allows) or `--get-flood T` (T threads asking for /metrics back to back), three
scrapes are then made as Prometheus makes them (10 s timeout), each reported with its status and time,
and the exporter's memory after them (docs/reliability.md, "Forged frames").
"""

from __future__ import annotations

import argparse
import os
import re
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tests.exporter.support import forged_flood

REPOSITORY = Path(__file__).resolve().parents[1]
WIDEST_SINGLE_ROW_LAYERS = 15_742  # 24 + names + 4·L + ⌈L/8⌉ bytes must stay within 65,000


def resident_mb(pid: int) -> tuple[float, float]:
    """(current, peak) resident memory of the process in MB, from /proc."""
    status = Path(f"/proc/{pid}/status").read_text()

    def megabytes(field: str) -> float:
        found = re.search(rf"^{field}:\s+(\d+) kB", status, re.M)
        if found is None:
            raise RuntimeError(f"/proc/{pid}/status has no {field} line")
        return int(found[1]) * 1024 / 1e6

    return megabytes("VmRSS"), megabytes("VmHWM")


def scrape(url: str) -> tuple[str, float]:
    start = time.perf_counter()
    with urllib.request.urlopen(url, timeout=600) as response:
        page = response.read().decode()
    return page, time.perf_counter() - start


def counted_frames(page: str) -> dict[str, float]:
    """Every frame counter of the page, summed per sample name and reason."""
    totals: dict[str, float] = {}
    for name, labels, value in re.findall(r"^(layerwatch_exporter_frames_\w+_total)(\{[^}]*\})? (\S+)$", page, re.M):
        reason = re.search(r'reason="([^"]+)"', labels or "")
        key = name + (f"{{{reason[1]}}}" if reason else "")
        totals[key] = totals.get(key, 0.0) + float(value)
    return totals


def report(label: str, pid: int, url: str) -> str:
    page, seconds = scrape(url)
    current, peak = resident_mb(pid)
    print(
        f"{label:>6}: RSS {current:7.1f} MB (peak {peak:7.1f} MB), /metrics {len(page.encode()):>12,} bytes "
        f"{page.count(chr(10)):>10,} lines, scrape {seconds * 1000:9.1f} ms"
    )
    return page


def scrapes_under_attack(url: str, pid: int, slow_readers: int, get_flood: int) -> None:
    port = int(url.split(":")[2].split("/")[0])
    readers = []
    for _ in range(slow_readers):
        reader = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        reader.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 1)
        reader.connect(("127.0.0.1", port))
        reader.sendall(b"GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n")
        readers.append(reader)
    stop = threading.Event()

    def flood() -> None:
        while not stop.is_set():
            try:
                with urllib.request.urlopen(url, timeout=30) as response:
                    response.read()
            except OSError:
                pass

    flooders = [threading.Thread(target=flood, daemon=True) for _ in range(get_flood)]
    for thread in flooders:
        thread.start()
    print(f"under attack: {slow_readers} slow readers, {get_flood} threads of GETs")
    try:
        for attempt in range(3):
            start = time.perf_counter()
            try:
                with urllib.request.urlopen(url, timeout=10) as response:
                    outcome = f"{response.status}, {len(response.read()):,} bytes"
            except urllib.error.HTTPError as exc:
                outcome = str(exc.code)
            except OSError as exc:
                outcome = f"failed ({exc})"
            print(f"  scrape {attempt + 1}: {outcome} in {time.perf_counter() - start:.2f} s")
        current, peak = resident_mb(pid)
        print(f"  RSS {current:.1f} MB (peak {peak:.1f} MB)")
    finally:
        stop.set()
        for thread in flooders:
            thread.join()
        for reader in readers:
            reader.close()


def main() -> None:
    parser = argparse.ArgumentParser(
        allow_abbrev=False, description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--checkout", type=Path, default=REPOSITORY, help="the exporter to run (default: this one)")
    parser.add_argument("--models", type=int, default=64, help="datagrams, each naming a new model (default 64)")
    parser.add_argument("--layers", type=int, default=WIDEST_SINGLE_ROW_LAYERS, help="layers per frame")
    parser.add_argument("--with-key", action="store_true", help="start the exporter with a frame key file")
    parser.add_argument("--slow-readers", type=int, default=0, help="then scrape under this many slow readers")
    parser.add_argument("--get-flood", type=int, default=0, help="then scrape under this many threads of GETs")
    parser.add_argument("exporter_args", nargs="*", help="further exporter flags (after --)")
    args = parser.parse_args()

    workdir = Path(tempfile.mkdtemp(prefix="frame-flood-"))
    extra = list(args.exporter_args)
    if args.with_key:
        key_file = workdir / "frame.key"
        key_file.write_bytes(os.urandom(32).hex().encode())
        key_file.chmod(0o600)
        extra += ["--frame-key-file", str(key_file)]
    log = workdir / "exporter.log"
    environment = dict(os.environ, PYTHONPATH=str(args.checkout.resolve()))
    command = [sys.executable, "-m", "layerwatch.cli.main", "exporter", "--listen", "127.0.0.1:0"]
    command += ["--http", "127.0.0.1:0", *extra]
    with open(log, "wb") as stderr:
        process = subprocess.Popen(
            command, cwd=args.checkout, env=environment, stdout=subprocess.DEVNULL, stderr=stderr
        )
    try:
        deadline = time.monotonic() + 30
        while not (ready := re.search(r"udp://[\d.]+:(\d+), serving http://[\d.]+:(\d+)", log.read_text())):
            if process.poll() is not None or time.monotonic() > deadline:
                sys.exit(f"the exporter did not start:\n{log.read_text()}")
            time.sleep(0.05)
        udp_port, http_port = map(int, ready.groups())
        url = f"http://127.0.0.1:{http_port}/metrics"
        print(f"exporter of {args.checkout} {' '.join(extra)}".rstrip())
        print(f"flood: {args.models} datagrams, each a new model of {args.layers:,} layers, 1 row, untagged")
        report("before", process.pid, url)

        sender = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        for data in forged_flood(args.models, args.layers):
            sender.sendto(data, ("127.0.0.1", udp_port))
            time.sleep(0.002)  # well within the receive buffer: every datagram reaches the exporter
        previous = -1.0
        while (current := resident_mb(process.pid)[0]) != previous:  # ingest done when memory settles
            previous = current
            time.sleep(1.0)
        report("after", process.pid, url)
        page = report("again", process.pid, url)  # the second scrape: the series-text cache is warm
        for name, value in sorted(counted_frames(page).items()):
            print(f"  {name} {value:g}")
        if args.slow_readers or args.get_flood:
            scrapes_under_attack(url, process.pid, args.slow_readers, args.get_flood)
    finally:
        process.terminate()
        process.wait(timeout=60)


if __name__ == "__main__":
    main()
