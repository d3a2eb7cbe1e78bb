"""`layerwatch top`: a terminal view of a live exporter, refreshing in place.

The view itself is exporter/live_view.py.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
import urllib.error

from exporter.live_view import CLEAR_SCREEN, render_screen
from layerwatch.ports import EXPORTER_HTTP_PORT, LOOPBACK
from layerwatch_cli import argtypes


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--url", default=f"http://{LOOPBACK}:{EXPORTER_HTTP_PORT}", help="the exporter (default %(default)s)"
    )
    parser.add_argument(
        "--interval", type=argtypes.interval, default=2.0, help="seconds between refreshes (default %(default)s)"
    )
    parser.add_argument("--once", action="store_true", help="print one view without terminal control codes and exit")


def run(args: argparse.Namespace) -> int:
    if args.once:
        try:
            print(render_screen(args.url))
        except (urllib.error.URLError, OSError) as exc:
            print(f"layerwatch top: cannot read {args.url}/metrics: {exc}", file=sys.stderr)
            return 1
        return 0
    try:
        while True:
            try:
                screen = render_screen(args.url)
            except (urllib.error.URLError, OSError) as exc:
                screen = f"layerwatch top: cannot read {args.url}/metrics: {exc} (retrying)"
            sys.stdout.write(CLEAR_SCREEN + screen + "\n")
            sys.stdout.flush()
            time.sleep(args.interval)
    except KeyboardInterrupt:
        return 0
    except BrokenPipeError:  # the reader went away (`layerwatch top | head`)
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # so the exit flush succeeds
        return 0
