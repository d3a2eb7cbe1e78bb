"""`layerwatch exporter`: receive gate frames over UDP, serve /metrics and /healthz over HTTP.

It runs until SIGTERM, SIGINT or SIGHUP (layerwatch_cli/signals.py: a clean stop, then the exit by
the signal); it has nothing to reload, every setting being a flag.
"""

from __future__ import annotations

import argparse
import logging
import sys
import threading
from pathlib import Path

from exporter.server import ExporterServer
from exporter.state import ExporterConfig, ExporterState
from layerwatch.ports import EXPORTER_HTTP_PORT, LOOPBACK
from layerwatch.statistics import MAX_WINDOW_OBSERVATIONS
from layerwatch.wire import DEFAULT_FRAMES_ADDRESS, load_frame_key
from layerwatch_cli import argtypes

log = logging.getLogger("layerwatch.exporter")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    defaults = ExporterConfig()
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
    parser.add_argument(
        "--window-seconds",
        type=argtypes.positive(float),
        default=defaults.window_seconds,
        help="the bimodality window forgets entropies older than this (default %(default)s)",
    )
    parser.add_argument(
        "--window-max-observations",
        type=argtypes.positive(int),
        default=defaults.window_max_observations,
        help=f"the window holds at most this many entropies per model, at most "
        f"{MAX_WINDOW_OBSERVATIONS} (default %(default)s)",
    )
    parser.add_argument(
        "--min-window-observations",
        type=argtypes.positive(int),
        default=defaults.min_window_observations,
        help="below this many entropies in the window the verdict is withheld (default %(default)s)",
    )
    parser.add_argument(
        "--per-layer",
        action="store_true",
        help="also export a 20-bucket histogram per layer (layers x models x 23 series)",
    )
    parser.add_argument(
        "--max-models",
        type=argtypes.positive(int),
        default=defaults.max_models,
        help="frames naming more distinct models than this are rejected (default %(default)s)",
    )
    parser.add_argument(
        "--max-layers",
        type=argtypes.positive(int),
        default=defaults.max_layers,
        help="frames with more layers than this are rejected and counted (default %(default)s)",
    )
    parser.add_argument(
        "--model-idle-seconds",
        type=argtypes.positive(float),
        default=defaults.model_idle_seconds,
        help="a model that sends no frame for this long is forgotten: its series and its slot among "
        "--max-models are freed, its layer count may change (default %(default)s)",
    )
    parser.add_argument(
        "--frame-key-file",
        type=Path,
        default=None,
        metavar="FILE",
        help="accept only gate frames authenticated with the key in FILE (the shim's "
        "--frame-key-file; owner-only permissions); others are rejected and counted (default: "
        "accept untagged frames)",
    )
    parser.add_argument(
        "--statistics-cache-seconds",
        type=argtypes.non_negative,
        default=defaults.statistics_cache_seconds,
        help="reuse the window statistics for this long across scrapes (default %(default)s)",
    )
    parser.add_argument(
        "--default-threshold",
        type=argtypes.fraction,
        default=defaults.default_threshold,
        metavar="TAU",
        help="skip threshold assumed for gate frames that carry none (wire version 1, older "
        "shims); such frames are counted (default %(default)s)",
    )
    parser.add_argument(
        "--min-routing-tokens",
        type=argtypes.positive(int),
        default=defaults.min_routing_tokens,
        help="below this many tokens in the window the routing verdict is withheld (default %(default)s)",
    )
    parser.add_argument(
        "--log-level", default="INFO", choices=["DEBUG", "INFO", "WARNING", "ERROR"], help="(default %(default)s)"
    )


def run(args: argparse.Namespace) -> int:
    logging.basicConfig(
        level=args.log_level, stream=sys.stderr, format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    try:
        frame_key = None if args.frame_key_file is None else load_frame_key(args.frame_key_file)
        config = ExporterConfig(
            window_seconds=args.window_seconds,
            window_max_observations=args.window_max_observations,
            min_window_observations=args.min_window_observations,
            per_layer=args.per_layer,
            max_models=args.max_models,
            max_layers=args.max_layers,
            model_idle_seconds=args.model_idle_seconds,
            frame_key=frame_key,
            statistics_cache_seconds=args.statistics_cache_seconds,
            default_threshold=args.default_threshold,
            min_routing_tokens=args.min_routing_tokens,
        )
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
        if args.frame_key_file is not None:
            log.info("accepting only gate frames authenticated with the key in %s", args.frame_key_file)
        threading.Event().wait()  # serves until a stop signal raises signals.Stopped here
    finally:
        server.stop()
        log.info("stopped")
    return 0  # not reached: only a signal ends the wait
