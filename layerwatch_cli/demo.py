"""`layerwatch demo`: the whole stack on the embedded demo model, in one terminal.

Starts the exporter and the shim (on the demo model unless --model is given), Prometheus and
Alertmanager with the repo's own configs when their binaries are installed, and a load generator
(sampled requests only, demo/loadgen.py); then shows the shim's shadow check (agreement, quality cost,
estimated perplexity increase) and the live entropy histogram (`layerwatch top`) until Ctrl-C or
--duration. Every process it started is stopped on the way out, whatever the way out is.
"""

from __future__ import annotations

import argparse
import math
import sys
import tempfile
import threading
import time
from pathlib import Path

from demo.loadgen import run_load
from demo.stack import DemoStack
from exporter.live_view import CLEAR_SCREEN, Samples, render_screen, scrape, total
from layerwatch import ports


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default=None, help="checkpoint folder (default: the embedded demo model)")
    parser.add_argument("--port", type=int, default=ports.SHIM_HTTP_PORT, help="shim HTTP port (default %(default)s)")
    parser.add_argument(
        "--exporter-port", type=int, default=ports.EXPORTER_HTTP_PORT, help="exporter HTTP port (default %(default)s)"
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
        help="share of requests the shim compares with the full-depth model (default %(default)s)",
    )
    parser.add_argument("--duration", type=float, default=0.0, help="stop after this many seconds (0 = until Ctrl-C)")
    parser.add_argument("--interval", type=float, default=2.0, help="seconds between screen refreshes")
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
        _show(shim_url, exporter_url, banner, args, stack)
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


def shadow_line(samples: Samples) -> str:
    """The shim's shadow check since it started, from its /metrics (docs/service.md, "Quality guard")."""
    tokens = total(samples, "layerwatch_shadow_tokens_total")
    checked = total(samples, "layerwatch_shadow_requests_total", outcome="checked")
    if not tokens:
        return f"shadow check: {checked:.0f} requests checked, no token yet"
    return (
        f"shadow check: {checked:.0f} requests, {tokens:.0f} tokens compared with full depth; agreement "
        f"{total(samples, 'layerwatch_shadow_agreements_total') / tokens:.3f}, quality cost "
        f"{total(samples, 'layerwatch_shadow_kl_nats_total') / tokens:.4f} nats/token, estimated perplexity "
        f"increase {math.expm1(total(samples, 'layerwatch_shadow_reverse_kl_nats_total') / tokens):+.1%}"
    )


def _show(shim_url: str, exporter_url: str, banner: str, args: argparse.Namespace, stack: DemoStack) -> None:
    deadline = time.monotonic() + args.duration if args.duration > 0 else float("inf")
    interactive = sys.stdout.isatty()
    while time.monotonic() < deadline:
        stack.check_alive()
        try:
            screen = shadow_line(scrape(shim_url)) + "\n\n" + render_screen(exporter_url)
        except OSError as exc:
            screen = f"shim or exporter not readable yet: {exc}"
        if interactive:
            sys.stdout.write(CLEAR_SCREEN + banner + "\n\n" + screen + "\n\n(Ctrl-C stops the demo)\n")
        else:
            sys.stdout.write(screen + "\n\n")
        sys.stdout.flush()
        time.sleep(min(args.interval, max(0.0, deadline - time.monotonic())))
