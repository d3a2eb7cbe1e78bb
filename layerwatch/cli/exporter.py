"""`layerwatch exporter`: receive gate frames over UDP, serve /metrics and /healthz over HTTP.

It runs until SIGTERM, SIGINT or SIGHUP (layerwatch/cli/signals.py: a clean stop, then the exit by
the signal); it has nothing to reload, every setting being a flag.
"""

from __future__ import annotations

import argparse
import logging
import sys
import threading
from dataclasses import dataclass

from layerwatch import argtypes
from layerwatch.exporter.server import ExporterServer
from layerwatch.exporter.state import ExporterConfig, ExporterState
from layerwatch.ports import EXPORTER_HTTP_PORT, LOOPBACK
from layerwatch.settings import add_flags, from_flags, log_level_setting, setting
from layerwatch.wire import DEFAULT_FRAMES_ADDRESS

log = logging.getLogger("layerwatch.exporter")


@dataclass(frozen=True, kw_only=True)
class ListenerSettings:
    """Where the exporter listens, and what it logs; its statistics' settings are ExporterConfig's."""

    listen: tuple[str, int] = setting(
        DEFAULT_FRAMES_ADDRESS,
        type=argtypes.listen_address,
        metavar="HOST:PORT",
        help="UDP address gate frames arrive on (default %(default)s)",
    )
    http: tuple[str, int] = setting(
        f"{LOOPBACK}:{EXPORTER_HTTP_PORT}",
        type=argtypes.listen_address,
        metavar="HOST:PORT",
        help="HTTP address for /metrics and /healthz (default %(default)s)",
    )
    log_level: str = log_level_setting()


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The listeners, ExporterConfig's settings (layerwatch/exporter/state.py), the log level."""
    add_flags(parser, ListenerSettings, ("listen", "http"))
    add_flags(parser, ExporterConfig)
    add_flags(parser, ListenerSettings, ("log_level",))


def run(args: argparse.Namespace) -> int:
    listeners = from_flags(ListenerSettings, args)
    logging.basicConfig(
        level=listeners.log_level, stream=sys.stderr, format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    try:
        config = from_flags(ExporterConfig, args)  # the key read from --frame-key-file
    except ValueError as exc:  # SecretFileError included
        print(f"layerwatch exporter: {exc}", file=sys.stderr)
        return 2
    try:
        server = ExporterServer(ExporterState(config), listeners.listen, listeners.http)
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
