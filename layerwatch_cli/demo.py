"""`layerwatch demo`: the whole stack on the embedded demo model, in one terminal.

Starts the exporter and the shim (on the demo model unless --model is given), Prometheus and
Alertmanager with the repo's own configs when their binaries are installed, and a load generator;
then shows the live entropy histogram (`layerwatch top`) until Ctrl-C or --duration. Every process it
started is stopped on the way out, whatever the way out is.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import threading
import time
from pathlib import Path

from demo.loadgen import run_load
from demo.stack import DemoStack
from exporter.live_view import CLEAR_SCREEN, render_screen
from layerwatch import ports
from layerwatch_cli import argtypes


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default=None, help="checkpoint folder (default: the embedded demo model)")
    parser.add_argument(
        "--port", type=argtypes.port, default=ports.SHIM_HTTP_PORT, help="shim HTTP port (default %(default)s)"
    )
    parser.add_argument(
        "--exporter-port",
        type=argtypes.port,
        default=ports.EXPORTER_HTTP_PORT,
        help="exporter HTTP port (default %(default)s)",
    )
    parser.add_argument("--prometheus-port", type=int, default=ports.PROMETHEUS_PORT, help="(default %(default)s)")
    parser.add_argument("--alertmanager-port", type=int, default=ports.ALERTMANAGER_PORT, help="(default %(default)s)")
    parser.add_argument("--no-prometheus", action="store_true", help="do not start Prometheus and Alertmanager")
    parser.add_argument("--concurrency", type=int, default=2, help="load generator clients (default %(default)s)")
    parser.add_argument("--max-tokens", type=int, default=48, help="tokens per generated completion")
    parser.add_argument(
        "--shadow-rate",
        type=float,
        default=0.5,
        help="share of greedy requests the shim re-checks at full depth (default %(default)s)",
    )
    parser.add_argument("--duration", type=float, default=0.0, help="stop after this many seconds (0 = until Ctrl-C)")
    parser.add_argument("--interval", type=argtypes.interval, default=2.0, help="seconds between screen refreshes")
    parser.add_argument("--workdir", default=None, help="where configs and logs go (default: a temporary folder)")


def run(args: argparse.Namespace) -> int:
    workdir = Path(args.workdir or tempfile.mkdtemp(prefix="layerwatch-demo-"))
    workdir.mkdir(parents=True, exist_ok=True)
    stack = DemoStack(workdir)
    stop = threading.Event()
    try:
        shim_url, exporter_url = stack.start_core(
            port=args.port, exporter_port=args.exporter_port, shadow_rate=args.shadow_rate, model=args.model
        )
        lines = [
            f"shim (OpenAI API)  {shim_url}/v1   metrics {shim_url}/metrics",
            f"exporter           {exporter_url}/metrics",
        ]
        if not args.no_prometheus:
            lines += stack.start_prometheus(
                shim_url, exporter_url, prometheus_port=args.prometheus_port, alertmanager_port=args.alertmanager_port
            )
        lines.append(f"logs and configs   {workdir}")
        banner = "\n".join(lines)
        print(banner, flush=True)

        load = threading.Thread(
            target=run_load,
            args=(shim_url, stack.model_name),
            kwargs=dict(duration=float("inf"), concurrency=args.concurrency, max_tokens=args.max_tokens, stop=stop),
            daemon=True,
        )
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


def _show(exporter_url: str, banner: str, args: argparse.Namespace, stack: DemoStack) -> None:
    deadline = time.monotonic() + args.duration if args.duration > 0 else float("inf")
    interactive = sys.stdout.isatty()
    while time.monotonic() < deadline:
        stack.check_alive()
        try:
            screen = render_screen(exporter_url)
        except OSError as exc:
            screen = f"exporter not readable yet: {exc}"
        if interactive:
            sys.stdout.write(CLEAR_SCREEN + banner + "\n\n" + screen + "\n\n(Ctrl-C stops the demo)\n")
        else:
            sys.stdout.write(screen + "\n\n")
        sys.stdout.flush()
        time.sleep(min(args.interval, max(0.0, deadline - time.monotonic())))
