"""Run inside a fresh network namespace (`unshare -n`): start `layerwatch serve --model DIR` and
`layerwatch exporter` with no address flags at all, so they use their real default ports and
addresses, then print as JSON what each process listens on and what a client sees.

    unshare -n sh -c 'ip link set lo up && exec python -m tests.reliability.default_listeners DIR'

A fresh namespace has only its own loopback, so the default ports (8000, 9410, 9411) are free
whatever else runs on the machine, and nothing in it can be reached from outside.
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
import urllib.request
from pathlib import Path

from layerwatch.demo.processes import LAYERWATCH_COMMAND, ManagedProcess

LAYERWATCH = LAYERWATCH_COMMAND
DEBUG_HEADER = "x-layerwatch-debug"


def listening_sockets(pid: int) -> list[dict[str, str | int]]:
    """The process's listening TCP sockets and bound UDP sockets, from /proc (its own namespace)."""
    inodes = set()
    for fd in Path(f"/proc/{pid}/fd").iterdir():
        try:
            target = os.readlink(fd)
        except OSError:
            continue
        if target.startswith("socket:["):
            inodes.add(target[len("socket:[") : -1])
    found = []
    for proto in ("tcp", "tcp6", "udp", "udp6"):
        lines = Path(f"/proc/{pid}/net/{proto}").read_text().splitlines()[1:]
        for line in lines:
            fields = line.split()
            local, remote, state, inode = fields[1], fields[2], fields[3], fields[9]
            listening = state == "0A" if proto.startswith("tcp") else remote.split(":")[1] == "0000"
            if inode in inodes and listening:
                found.append({"proto": proto, "address": _address(local), "port": int(local.split(":")[1], 16)})
    return found


def _address(hex_address: str) -> str:
    raw = bytes.fromhex(hex_address.split(":")[0])
    if len(raw) == 4:
        return ".".join(str(b) for b in reversed(raw))
    words = [raw[i : i + 4][::-1].hex() for i in range(0, 16, 4)]  # each 32-bit word is little-endian
    return ":".join("".join(words)[i : i + 4] for i in range(0, 32, 4))


def main(model_dir: str) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("LAYERWATCH_")}  # real defaults only
    env["OMP_NUM_THREADS"] = "1"
    os.environ.clear()
    os.environ.update(env)
    work = Path(tempfile.mkdtemp(prefix="layerwatch-defaults-"))
    exporter = ManagedProcess("exporter", [*LAYERWATCH, "exporter"], work / "exporter.log")
    serve = ManagedProcess("serve", [*LAYERWATCH, "serve", "--model", model_dir], work / "serve.log")
    try:
        exporter.wait_http("http://127.0.0.1:9411/healthz", timeout=30)
        serve.wait_http("http://127.0.0.1:8000/healthz", timeout=90)
        body = json.dumps({"model": Path(model_dir).name, "prompt": "In the beginning", "max_tokens": 3}).encode()
        request = urllib.request.Request(
            "http://127.0.0.1:8000/v1/completions", body, {"content-type": "application/json", DEBUG_HEADER: "true"}
        )
        with urllib.request.urlopen(request, timeout=30) as response:
            headers = {k.lower() for k in response.headers}
            usage = json.loads(response.read())["usage"]
        with urllib.request.urlopen("http://127.0.0.1:8000/metrics", timeout=30) as response:
            metrics = response.read().decode()
        print(
            json.dumps(
                {
                    "serve": listening_sockets(serve.proc.pid),
                    "exporter": listening_sockets(exporter.proc.pid),
                    "response_headers": sorted(headers),
                    "usage": usage,
                    "nvml_up": next(
                        float(line.split()[-1])
                        for line in metrics.splitlines()
                        if line.startswith("layerwatch_nvml_up ")
                    ),
                }
            )
        )
    finally:
        serve.stop()
        exporter.stop()


if __name__ == "__main__":
    main(sys.argv[1])
