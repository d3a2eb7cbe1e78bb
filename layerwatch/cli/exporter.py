"""`layerwatch exporter`: receive gate frames over UDP, serve /metrics and /healthz over HTTP.

It runs until SIGTERM, SIGINT or SIGHUP (layerwatch/cli/signals.py: a clean stop, then the exit by
the signal); it has nothing to reload, every setting being a flag.
"""

from __future__ import annotations

import argparse
import logging
import sys
import threading

from layerwatch import argtypes
from layerwatch.exporter.server import ExporterServer
from layerwatch.exporter.state import ExporterConfig, ExporterState
from layerwatch.ports import EXPORTER_HTTP_PORT, LOOPBACK
from layerwatch.settings import add_flags, from_flags
from layerwatch.wire import DEFAULT_FRAMES_ADDRESS

log = logging.getLogger("layerwatch.exporter")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The listeners, ExporterConfig's settings (layerwatch/exporter/state.py), the log level."""
    parser.add_argument(
        "--listen",
        type=argtypes.listen_address,
        default=DEFAULT_FRAMES_ADDRESS,
        metavar="HOST:PORT",
        help="UDP address gate frames arrive on (default %(default)s)",
    )
    parser.add_argument(
        "--http",
        type=argtypes.listen_address,
        default=f"{LOOPBACK}:{EXPORTER_HTTP_PORT}",
        metavar="HOST:PORT",
        help="HTTP address for /metrics and /healthz (default %(default)s)",
    )
    add_flags(parser, ExporterConfig)
    parser.add_argument(
        "--log-level",
        default="INFO",
        type=str.upper,  # as serve's lower-case names: one LAYERWATCH_LOG_LEVEL serves both
        choices=["DEBUG", "INFO", "WARNING", "ERROR"],
        help="(default %(default)s)",
    )


def run(args: argparse.Namespace) -> int:
    logging.basicConfig(
        level=args.log_level, stream=sys.stderr, format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    try:
        config = from_flags(ExporterConfig, args)  # the key read from --frame-key-file
    except ValueError as exc:  # SecretFileError included
        print(f"layerwatch exporter: {exc}", file=sys.stderr)
        return 2
    try:
        server = ExporterServer(ExporterState(config), args.listen, args.http)
    except OSError as exc:
        print(f"layerwatch exporter: cannot bind: {exc}", file=sys.stderr)
        return 1

    try:
        server.start()
        frames_host, frames_port = server.frames_address
        http_host, http_port = server.http_address
        log.info(
            "receiving gate frames on udp://%s:%d, serving http://%s:%d/metrics",
            frames_host,
            frames_port,
            http_host,
            http_port,
        )
        if args.frame_key is not None:  # (the flag's value: the file)
            log.info("accepting only gate frames authenticated with the key in %s", args.frame_key)
        threading.Event().wait()  # serves until a stop signal raises signals.Stopped here
    finally:
        server.stop()
        log.info("stopped")
    return 0  # not reached: only a signal ends the wait
