"""`layerwatch demo`: the whole stack on the embedded demo model, in one terminal.

Starts the exporter and the shim (on the demo model unless --model is given), Prometheus and
Alertmanager with the repo's own configs when their binaries are installed, and a load generator;
then shows the live entropy histogram (`layerwatch top`) until Ctrl-C or --duration. Every process it
started is stopped on the way out, whatever the way out is.
"""

from __future__ import annotations

import argparse
import shutil
import socket
import sys
import tempfile
import threading
import time
from pathlib import Path

from alerts import config
from alerts.profile import load_profiles
from exporter.cli_top import render_screen
from layerwatch.deploy import render_stack
from layerwatch.loadgen import run_load
from layerwatch.processes import ManagedProcess, free_port

_CLEAR = "\x1b[H\x1b[2J"
PROFILES_DIR = Path(config.__file__).parent / "profiles"  # the committed per-model profiles


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default=None, help="checkpoint folder (default: the embedded demo model)")
    parser.add_argument("--port", type=int, default=8000, help="shim HTTP port (default %(default)s)")
    parser.add_argument("--exporter-port", type=int, default=9411, help="exporter HTTP port (default %(default)s)")
    parser.add_argument("--prometheus-port", type=int, default=9090, help="(default %(default)s)")
    parser.add_argument("--alertmanager-port", type=int, default=9093, help="(default %(default)s)")
    parser.add_argument("--no-prometheus", action="store_true", help="do not start Prometheus and Alertmanager")
    parser.add_argument("--concurrency", type=int, default=2, help="load generator clients (default %(default)s)")
    parser.add_argument("--max-tokens", type=int, default=48, help="tokens per generated completion")
    parser.add_argument("--shadow-rate", type=float, default=0.5,
                        help="share of greedy requests the shim re-checks at full depth (default %(default)s)")
    parser.add_argument("--duration", type=float, default=0.0, help="stop after this many seconds (0 = until Ctrl-C)")
    parser.add_argument("--interval", type=float, default=2.0, help="seconds between screen refreshes")
    parser.add_argument("--workdir", default=None, help="where configs and logs go (default: a temporary folder)")


def run(args: argparse.Namespace) -> int:
    workdir = Path(args.workdir or tempfile.mkdtemp(prefix="layerwatch-demo-"))
    workdir.mkdir(parents=True, exist_ok=True)
    stack = _Stack(workdir)
    stop = threading.Event()
    try:
        shim_url, exporter_url = stack.start_core(args)
        lines = [f"shim (OpenAI API)  {shim_url}/v1   metrics {shim_url}/metrics",
                 f"exporter           {exporter_url}/metrics"]
        if not args.no_prometheus:
            lines += stack.start_prometheus(args, shim_url, exporter_url)
        lines.append(f"logs and configs   {workdir}")
        banner = "\n".join(lines)
        print(banner, flush=True)

        load = threading.Thread(target=run_load, args=(shim_url, stack.model_name),
                                kwargs=dict(duration=float("inf"), concurrency=args.concurrency,
                                            max_tokens=args.max_tokens, stop=stop), daemon=True)
        load.start()
        _show(exporter_url, banner, args, stack)
    except KeyboardInterrupt:
        pass
    except (RuntimeError, TimeoutError) as exc:
        print(f"layerwatch demo: {exc}", file=sys.stderr)
        return 1
    finally:
        stop.set()
        stack.stop_all()
    print("layerwatch demo: stopped every process it started.")
    return 0


def _show(exporter_url: str, banner: str, args: argparse.Namespace, stack: "_Stack") -> None:
    deadline = time.monotonic() + args.duration if args.duration > 0 else float("inf")
    interactive = sys.stdout.isatty()
    while time.monotonic() < deadline:
        stack.check_alive()
        try:
            screen = render_screen(exporter_url)
        except OSError as exc:
            screen = f"exporter not readable yet: {exc}"
        if interactive:
            sys.stdout.write(_CLEAR + banner + "\n\n" + screen + "\n\n(Ctrl-C stops the demo)\n")
        else:
            sys.stdout.write(screen + "\n\n")
        sys.stdout.flush()
        time.sleep(min(args.interval, max(0.0, deadline - time.monotonic())))


class _Stack:
    """The processes of one demo run, stopped in reverse order of starting."""

    def __init__(self, workdir: Path) -> None:
        self.workdir = workdir
        self.processes: list[ManagedProcess] = []
        self.model_name = ""

    def _start(self, name: str, argv: list[str]) -> ManagedProcess:
        proc = ManagedProcess(name, argv, self.workdir / f"{name}.log")
        self.processes.append(proc)
        return proc

    def start_core(self, args: argparse.Namespace) -> tuple[str, str]:
        cli = [sys.executable, "-m", "layerwatch.cli"]
        udp_port = free_port(socket.SOCK_DGRAM)
        exporter_url = f"http://127.0.0.1:{args.exporter_port}"
        exporter = self._start("exporter", cli + ["exporter", "--listen", f"127.0.0.1:{udp_port}",
                                                  "--http", f"127.0.0.1:{args.exporter_port}"])
        shim_argv = cli + ["serve", "--port", str(args.port), "--exporter-address", f"127.0.0.1:{udp_port}",
                           "--shadow-rate", str(args.shadow_rate)]
        if args.model:
            shim_argv += ["--model", args.model]
        shim = self._start("shim", shim_argv)
        exporter.wait_http(exporter_url + "/healthz", timeout=30)
        shim_url = f"http://127.0.0.1:{args.port}"
        shim.wait_http(shim_url + "/readyz", timeout=180)
        self.model_name = _served_model(shim_url)
        return shim_url, exporter_url

    def start_prometheus(self, args: argparse.Namespace, shim_url: str, exporter_url: str) -> list[str]:
        if not (shutil.which("prometheus") and shutil.which("prometheus-alertmanager")):
            return ["prometheus         not installed: skipped (Debian packages prometheus, prometheus-alertmanager)"]
        paths = render_stack(self.workdir / "config", profiles=load_profiles(PROFILES_DIR),
                             shim_targets=[_host_port(shim_url)], exporter_targets=[_host_port(exporter_url)],
                             alertmanager_target=f"127.0.0.1:{args.alertmanager_port}",
                             pager_url=config.PAGER_URL, ticket_url=config.TICKET_URL)
        am_url = f"http://127.0.0.1:{args.alertmanager_port}"
        prom_url = f"http://127.0.0.1:{args.prometheus_port}"
        am = self._start("alertmanager", ["prometheus-alertmanager", f"--config.file={paths.alertmanager_config}",
                                          f"--storage.path={self.workdir / 'alertmanager-data'}",
                                          f"--web.listen-address=127.0.0.1:{args.alertmanager_port}",
                                          "--cluster.listen-address="])
        prom = self._start("prometheus", ["prometheus", f"--config.file={paths.prometheus_config}",
                                          f"--storage.tsdb.path={self.workdir / 'prometheus-data'}",
                                          f"--web.listen-address=127.0.0.1:{args.prometheus_port}"])
        am.wait_http(am_url + "/-/ready", timeout=30)
        prom.wait_http(prom_url + "/-/ready", timeout=30)
        return [f"prometheus         {prom_url}/alerts", f"alertmanager       {am_url}"]

    def check_alive(self) -> None:
        for proc in self.processes:
            if not proc.running():
                raise RuntimeError(f"{proc.name} exited unexpectedly:\n{proc.log_tail()}")

    def stop_all(self) -> None:
        for proc in reversed(self.processes):
            proc.stop()


def _served_model(shim_url: str) -> str:
    import json
    import urllib.request

    with urllib.request.urlopen(shim_url + "/v1/models", timeout=10) as resp:
        return json.load(resp)["data"][0]["id"]


def _host_port(url: str) -> str:
    return url.split("://", 1)[1]
