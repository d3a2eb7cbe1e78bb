"""`layerwatch serve`: the gated model behind an OpenAI-compatible API, with metrics and gate frames.

Every flag is also read from LAYERWATCH_<FLAG> (see layerwatch/cli/main.py). docs/service.md has the
details: API, metrics semantics, gate frames, shadow checks, readiness and security notes.
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import logging
import os
import signal
from pathlib import Path

from layerwatch.catalog import DEFAULT_REQUEST_RUNAWAY_SKIP_FRACTION
from layerwatch.inference_shim.runtime.demo_model import DEMO_MODEL_DIR, demo_model_present, served_model_name
from layerwatch.inference_shim.service.http_protocol import HTTPLimits
from layerwatch.inference_shim.service.settings import SERVE_GROUPS, ServeSettings
from layerwatch.ports import http_url, reserve
from layerwatch.settings import add_flags, from_flags


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """One group of flags per concern, each flag a field of ServeSettings (service/settings.py)."""
    for concern, title in SERVE_GROUPS:
        add_flags(parser.add_argument_group(title), concern)


def settings_from_arguments(args: argparse.Namespace) -> ServeSettings:
    """The flags as ServeSettings (one flag per field); no --model means the embedded demo model."""
    if args.model_dir is None:
        return from_flags(ServeSettings, args, model_dir=DEMO_MODEL_DIR)
    return from_flags(ServeSettings, args)


def profile_runaway_fraction(settings: ServeSettings, profiles_dir: Path | None = None) -> tuple[float, str] | None:
    """The served model's request runaway cut-off from its profile, and the profile's path; None when
    layerwatch/alerts/profiles has no profile for the model (or cannot be read). The model name is the one the
    service will report (`served_model_name`)."""
    from layerwatch.alerts.profile_file import PROFILES_DIR, ProfileError, load_profile

    model_name = served_model_name(settings.model_dir, settings.model_name)
    for path in sorted((profiles_dir or PROFILES_DIR).glob("*.yaml")):
        try:
            profile = load_profile(path)
        except ProfileError as exc:  # (every way a file can be unreadable: load_profile says which)
            logging.getLogger("layerwatch.serve").warning("ignoring a broken profile: %s", exc)
            continue  # `layerwatch generate --check` reports it too; serving goes on
        if profile.model_name == model_name:
            return profile.request_tail.runaway_skip_fraction, str(path)
    return None


def run(args: argparse.Namespace) -> int:
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    log = logging.getLogger("layerwatch.serve")
    # Until the server runs, SIGHUP is logged and ignored, SIGTERM and SIGINT stop the start (logged):
    # layerwatch/cli/main.py set that up before importing this.

    import uvicorn

    from layerwatch.inference_shim.runtime.checkpoint import CheckpointError
    from layerwatch.inference_shim.runtime.gates import GateFileError
    from layerwatch.inference_shim.runtime.model import CompileError
    from layerwatch.inference_shim.service.app import create_app
    from layerwatch.inference_shim.service.http_protocol import BoundedH11Protocol, ConnectionRefusals, fit_open_files
    from layerwatch.inference_shim.service.server import ShimServer
    from layerwatch.inference_shim.service.shim import ShimService, export_gates

    settings = settings_from_arguments(args)
    if settings.export_gates is not None:
        try:
            sha256 = export_gates(settings)
        except (CheckpointError, GateFileError, ValueError, OSError) as exc:
            log.error("cannot export the gates: %s", exc)
            return 2
        log.info("wrote the gates to %s (gates_sha256=%s)", settings.export_gates, sha256)
        return 0
    if settings.request_runaway_fraction is None:
        found = profile_runaway_fraction(settings)
        fraction, source = found if found else (DEFAULT_REQUEST_RUNAWAY_SKIP_FRACTION, "the default")
        settings = dataclasses.replace(settings, request_runaway_fraction=fraction)
        log.info("request runaway fraction %g (from %s)", fraction, source)
    if args.model_dir is None and not demo_model_present():
        log.error(
            "cannot start: the demo model is not in %s; build it with `layerwatch train-demo` or pass --model DIR",
            DEMO_MODEL_DIR,
        )
        return 2
    try:  # the port before the model loads (minutes): a taken one fails at once
        api = reserve((settings.host, settings.port), "the API", "--host/--port")
    except OSError as exc:
        log.error("cannot start: %s", exc)
        return 2
    try:
        service = ShimService.load(settings)
    except (CheckpointError, GateFileError, CompileError, ValueError, OSError) as exc:
        api.close()
        log.error("cannot start: %s", exc)
        return 2
    log.info(
        "serving %s (%d layers, gates_sha256=%s) on %s",
        service.model_name,
        service.model.config.num_layers,
        service.gates_sha256,
        http_url(api.getsockname()),  # where it is bound (--port 0: the port the system chose)
    )
    limits = HTTPLimits(
        settings.max_header_bytes,
        settings.header_timeout_seconds,
        fit_open_files(settings.max_connections),
        settings.send_timeout_seconds,
    )
    config = uvicorn.Config(
        create_app(service),
        host=settings.host,
        port=settings.port,
        log_level=settings.log_level,
        timeout_graceful_shutdown=5,
        http=BoundedH11Protocol.bounded(limits, ConnectionRefusals(service.registry, service.model_name)),
    )
    # From here the server answers SIGTERM and SIGINT with a drain (its own handlers, which restore
    # these defaults when it is done, and then raise the signal again to exit by it).
    for signum, default in ((signal.SIGTERM, signal.SIG_DFL), (signal.SIGINT, signal.default_int_handler)):
        if signal.getsignal(signum) is not signal.SIG_IGN:
            signal.signal(signum, default)
    # What start-up made (torch, the model, the app: a few million objects) lives as long as the
    # server: out of the garbage collector's sight, whose full passes over it held the GIL, and so
    # the event loop, for 0.5 s at the start of a request of 128 choices (/healthz waiting).
    gc.freeze()
    # uvicorn listens on it once the service has started (and, given a socket, does not log where)
    try:
        ShimServer(config, service).run(sockets=[api])
    except KeyboardInterrupt:  # uvicorn re-raises the SIGINT it drained on: exit by it, as SIGTERM exits,
        signal.signal(signal.SIGINT, signal.SIG_DFL)  # not with a traceback and status 1
        os.kill(os.getpid(), signal.SIGINT)
    return 0
