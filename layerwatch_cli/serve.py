"""`layerwatch serve`: the gated model behind an OpenAI-compatible API, with metrics and gate frames.

Every flag is also read from LAYERWATCH_<FLAG> (see layerwatch_cli/main.py). docs/service.md has the
details: API, metrics semantics, gate frames, shadow checks, readiness and security notes.
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import os
import signal
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

from inference_shim.runtime.checkpoint import DTYPES
from inference_shim.runtime.demo_model import DEMO_MODEL_DIR, DEMO_MODEL_NAME, demo_model_present
from inference_shim.runtime.model import KV_POLICIES
from inference_shim.service.depth import REQUEST_FIELD, parse_rollout_levels, parse_threshold_range
from inference_shim.service.http_protocol import HTTPLimits
from inference_shim.service.shim import DEFAULT_MAX_PROMPT_TOKENS, DEFAULT_MAX_TOKENS_CAP, ServeSettings
from layerwatch.catalog import DEFAULT_REQUEST_RUNAWAY_SKIP_FRACTION
from layerwatch.ports import LOOPBACK, SHIM_HTTP_PORT, SHIM_MITIGATION_PORT, http_url, reserve
from layerwatch.skip_policy import SKIP_RULES
from layerwatch_cli import argtypes
from layerwatch_cli.model_arguments import add_depth_arguments

T = TypeVar("T")
LOG_LEVELS = ("debug", "info", "warning", "error")
# Every flag below that sets a ServeSettings field has that field's name as its dest and its default
# as its default: ServeSettings is the one source of both (tests/test_cli.py holds serve to that).
SETTINGS_DEFAULTS = {
    f.name: f.default for f in dataclasses.fields(ServeSettings) if f.default is not dataclasses.MISSING
}


def _argument(parse: Callable[[str], T]) -> Callable[[str], T]:
    """A parser raising ValueError as an argparse type: its message becomes the flag's error."""

    def parsed(text: str) -> T:
        try:
            return parse(text)
        except ValueError as exc:
            raise argparse.ArgumentTypeError(str(exc)) from None

    return parsed


def _model_arguments(parser: argparse.ArgumentParser) -> None:
    """The checkpoint, its gates (the drills, the reload watch), the device."""
    model = parser.add_argument_group("model")
    model.add_argument(
        "--model",
        dest="model_dir",
        type=Path,
        default=None,
        metavar="DIR",
        help="Hugging Face checkpoint folder (default: the embedded demo model)",
    )
    model.add_argument(
        "--gates",
        dest="gates_path",
        type=Path,
        default=SETTINGS_DEFAULTS["gates_path"],
        metavar="FILE",
        help="gate weights (default: DIR/gates.safetensors)",
    )
    model.add_argument(
        "--model-name",
        default=SETTINGS_DEFAULTS["model_name"],
        help=f"name clients use and metrics carry (default: the folder's name; {DEMO_MODEL_NAME} for the demo model)",
    )
    model.add_argument(
        "--reset-gates",
        action="store_true",
        help="serve freshly initialised gates instead of the gate file: simulates the 'gate "
        "weights overwritten' incident (layerwatch_model_info's gates_sha256 changes)",
    )
    model.add_argument(
        "--static-gates",
        action="store_true",
        help="serve each layer's gate as a constant at its healthy mean score (measured from the gate "
        "file at start-up): the same layers are skipped for every token, a static-pruning drill "
        "(layerwatch_model_info's gates_sha256 changes)",
    )
    model.add_argument(
        "--shuffle-gates",
        action="store_true",
        help="serve the gate file's gates on the wrong layers (gate l gets layer (l + L/2) mod L's "
        "weights): a drill for gates that no longer track how much their layer matters "
        "(layerwatch_model_info's gates_sha256 changes; LayerwatchGateMiscalibrated should page)",
    )
    model.add_argument(
        "--scramble-gates",
        action="store_true",
        help="serve each gate on its own layer but reading a permuted hidden state (feature j from feature "
        "(j + d/2) mod d; the same weights and biases): a drill for gates that react to every token, but to "
        "the wrong features (layerwatch_model_info's gates_sha256 changes; LayerwatchGateMiscalibrated should page)",
    )
    model.add_argument(
        "--gates-watch-seconds",
        type=float,
        default=SETTINGS_DEFAULTS["gates_watch_seconds"],
        metavar="S",
        help="check the gate file for a replacement this often: a complete, valid one is swapped in "
        "between decode steps, anything else is rejected and the loaded gates keep serving "
        "(0: never; else at least 0.1; default %(default)s)",
    )
    model.add_argument("--device", default=SETTINGS_DEFAULTS["device"], help="torch device: cpu, cuda, cuda:1, ...")
    model.add_argument("--dtype", default=SETTINGS_DEFAULTS["dtype"], choices=tuple(DTYPES))
    model.add_argument(
        "--compile",
        action="store_true",
        help="torch.compile each layer's attention and FFN bodies at start-up (the skip decision stays "
        "eager: skipped layers still do not run); docs/performance.md has what it buys",
    )


def _skipping_arguments(parser: argparse.ArgumentParser) -> None:
    """The skip policy served (unset: the gate file's), the KV policy and the depth execution."""
    policy = parser.add_argument_group("skipping")
    policy.add_argument(
        "--threshold",
        type=argtypes.fraction,
        default=SETTINGS_DEFAULTS["threshold"],
        help="skip threshold on the gate entropy (default: the gate file's calibrated value)",
    )
    policy.add_argument(
        "--patience",
        type=int,
        default=SETTINGS_DEFAULTS["patience"],
        help="consecutive tokens below the threshold before a layer is skipped; under the ewma rule, the "
        "decode steps a sequence runs full depth before its first skip (default: the gate file's)",
    )
    policy.add_argument(
        "--skip-rule",
        choices=SKIP_RULES,
        default=SETTINGS_DEFAULTS["skip_rule"],
        help="streak: skip a layer after --patience consecutive scores below the threshold; ewma: skip "
        "while the moving average of its scores is below the threshold (default: the gate file's)",
    )
    policy.add_argument(
        "--ewma-alpha",
        type=argtypes.positive_fraction,
        default=SETTINGS_DEFAULTS["ewma_alpha"],
        metavar="A",
        help="the ewma rule's weight of the newest score, in (0, 1] (default: the gate file's)",
    )
    policy.add_argument(
        "--protected-layers",
        type=argtypes.layer_numbers,
        default=SETTINGS_DEFAULTS["protected_layers"],
        metavar="L,L,...",
        help="layers never skipped (default: the first and the last)",
    )
    add_depth_arguments(policy)  # ServeSettings' defaults: the same DEPTH_MODES[0] and DEFAULT_VOTE
    policy.add_argument(
        "--kv-policy",
        default=SETTINGS_DEFAULTS["kv_policy"],
        choices=KV_POLICIES,
        help="what the KV cache holds for a skipped layer: K/V projected from its input, or "
        "nothing (the position is left out of that layer's attention)",
    )


def _depth_arguments(parser: argparse.ArgumentParser) -> None:
    """The skip threshold each request runs at, and how a batch runs the layers its rows skip."""
    depth = parser.add_argument_group('depth per request (docs/service.md, "Depth per request")')
    depth.add_argument(
        "--request-threshold-range",
        type=_argument(parse_threshold_range),
        default=SETTINGS_DEFAULTS["request_threshold_range"],
        metavar="LO:HI",
        help=f"accept the request field `{REQUEST_FIELD}` (the request's own skip threshold) within "
        "[LO, HI]; outside it, 400 (default: the field is refused with a 400)",
    )
    depth.add_argument(
        "--long-prompt-tokens",
        type=argtypes.positive(int),
        default=SETTINGS_DEFAULTS["long_prompt_tokens"],
        metavar="N",
        help="prompts over N tokens run at --long-prompt-threshold (default: no such rule)",
    )
    depth.add_argument(
        "--long-prompt-threshold",
        type=argtypes.fraction,
        default=SETTINGS_DEFAULTS["long_prompt_threshold"],
        metavar="T",
        help="the skip threshold of long prompts (default %(default)s: full depth)",
    )
    depth.add_argument(
        "--complexity-cutoff",
        type=argtypes.fraction,
        default=SETTINGS_DEFAULTS["complexity_cutoff"],
        metavar="C",
        help="complexity pre-check: a prompt whose complexity score (share of its prefill gate scores "
        "below the threshold) is at least C runs at --complexity-threshold (default: off; "
        "layerwatch_prompt_complexity shows the scores either way)",
    )
    depth.add_argument(
        "--complexity-threshold",
        type=argtypes.fraction,
        default=SETTINGS_DEFAULTS["complexity_threshold"],
        metavar="T",
        help="the skip threshold of complex prompts (default %(default)s: full depth)",
    )
    depth.add_argument(
        "--rollout-levels",
        type=_argument(parse_rollout_levels),
        default=SETTINGS_DEFAULTS["rollout_levels"],
        metavar="LEVELS",
        help="staged rollout: levels separated by ';', each enabling skipping for the requests meeting "
        "all of share=S (a share of requests), max_tokens=N (at most N tokens asked), min_temperature=T "
        "(sampling at T or above); the others run at full depth. A demotion (on a paging alert) drops to "
        "the previous level (e.g. 'share=0.1;share=0.5;share=1'; default: skipping for every request)",
    )
    depth.add_argument(
        "--rollout-level",
        type=argtypes.positive(int),
        default=SETTINGS_DEFAULTS["rollout_level"],
        metavar="N",
        help="start at rollout level N, from 1 (default: the last)",
    )
    depth.add_argument(
        "--rollout-demotion-holdoff-minutes",
        type=float,
        default=SETTINGS_DEFAULTS["rollout_demotion_holdoff_minutes"],
        metavar="M",
        help="after a demotion, further paging alerts demote no further for M minutes: one incident "
        "pages once per alert and per instance (default %(default)s)",
    )


def _server_arguments(parser: argparse.ArgumentParser) -> None:
    """The HTTP listener and its bounds, the batch and the queue, the request limits."""
    server = parser.add_argument_group("server")
    server.add_argument("--host", default="127.0.0.1", help="bind address (loopback by default)")
    server.add_argument("--port", type=argtypes.port, default=SHIM_HTTP_PORT)
    server.add_argument(
        "--max-batch-size",
        type=int,
        default=SETTINGS_DEFAULTS["max_batch_size"],
        help="sequences decoded together; new requests join at step boundaries",
    )
    server.add_argument(
        "--max-waiting-requests",
        type=int,
        default=SETTINGS_DEFAULTS["max_waiting_requests"],
        metavar="N",
        help="requests that may wait for a batch slot (being read, tokenized or queued); beyond that, new "
        "requests get 429 with Retry-After (default %(default)s)",
    )
    server.add_argument(
        "--drain-timeout-seconds",
        type=float,
        default=SETTINGS_DEFAULTS["drain_timeout_seconds"],
        metavar="S",
        help="on SIGTERM, stop admitting (503) and give in-flight requests this long to finish before "
        "cutting them off; keep it under the orchestrator's kill grace period (default %(default)s)",
    )
    server.add_argument(
        "--max-tokens-cap",
        type=int,
        default=SETTINGS_DEFAULTS["max_tokens_cap"],
        help=f"largest max_tokens a request may ask for (default: {DEFAULT_MAX_TOKENS_CAP}, or "
        f"less to fit the model's context)",
    )
    server.add_argument(
        "--max-prompt-tokens",
        type=int,
        default=SETTINGS_DEFAULTS["max_prompt_tokens"],
        help=f"longest prompt accepted, in tokens (default: {DEFAULT_MAX_PROMPT_TOKENS}, or less "
        f"to fit the model's context with the cap)",
    )
    server.add_argument(
        "--max-body-bytes", type=int, default=SETTINGS_DEFAULTS["max_body_bytes"], help="largest request body accepted"
    )
    server.add_argument(
        "--body-timeout-seconds",
        type=float,
        default=SETTINGS_DEFAULTS["body_timeout_seconds"],
        help="a request body must arrive within this many seconds, else 408 (slow clients)",
    )
    server.add_argument(
        "--max-header-bytes",
        type=argtypes.positive(int),
        default=HTTPLimits.max_head_bytes,
        metavar="N",
        help="largest request line and headers accepted, else 431 (default %(default)s)",
    )
    server.add_argument(
        "--header-timeout-seconds",
        type=argtypes.positive(float),
        default=HTTPLimits.head_timeout,
        metavar="S",
        help="a request's line and headers must arrive within this many seconds of the connection opening "
        "(or of its previous answer), else 408 (slow clients; default %(default)s)",
    )
    server.add_argument(
        "--max-connections",
        type=argtypes.positive(int),
        default=HTTPLimits.max_connections,
        metavar="N",
        help="open connections at most: one more closes the one waiting longest for its request head, or gets "
        "503 when every connection has a request in (default %(default)s)",
    )
    server.add_argument(
        "--allow-debug",
        action="store_true",
        help="honour the x-layerwatch-debug request header (returns per-token layer activity)",
    )
    server.add_argument("--log-level", default="info", choices=LOG_LEVELS)


def _telemetry_arguments(parser: argparse.ArgumentParser) -> None:
    """Gate frames, traces, the request runaway cut-off, the audit trail and the shadow check."""
    telemetry = parser.add_argument_group("telemetry")
    telemetry.add_argument(
        "--exporter-address",
        default=SETTINGS_DEFAULTS["exporter_address"],
        metavar="HOST:PORT",
        help="where gate frames go over UDP (empty: no frames)",
    )
    telemetry.add_argument(
        "--shim-id",
        default=SETTINGS_DEFAULTS["shim_id"],
        help="identifies this process in gate frames, one per process (default: hostname-pid-random, new each start)",
    )
    telemetry.add_argument(
        "--frame-key-file",
        type=Path,
        default=SETTINGS_DEFAULTS["frame_key_file"],
        metavar="FILE",
        help="authenticate gate frames with the key in FILE (the exporter's --frame-key-file; "
        "owner-only permissions, at least 32 bytes, e.g. `openssl rand -hex 32`; default: untagged frames)",
    )
    telemetry.add_argument(
        "--trace-file",
        type=Path,
        default=SETTINGS_DEFAULTS["trace_file"],
        help="also write every decoded token's scores and skips as a JSON Lines trace",
    )
    telemetry.add_argument(
        "--trace-max-bytes",
        type=int,
        default=SETTINGS_DEFAULTS["trace_max_bytes"],
        help="stop writing the trace file at this size",
    )
    telemetry.add_argument(
        "--request-runaway-fraction",
        type=argtypes.fraction,
        default=SETTINGS_DEFAULTS["request_runaway_fraction"],
        metavar="F",
        help="a request skipping more than this share of its decode layer evaluations is runaway: "
        "the layers it skipped are counted (layerwatch_request_runaway_layer_skips_total); a bucket edge "
        "of layerwatch_request_skip_fraction (default: request_tail.runaway_skip_fraction of the served "
        f"model's profile in alerts/profiles, else {DEFAULT_REQUEST_RUNAWAY_SKIP_FRACTION})",
    )
    telemetry.add_argument(
        "--otlp-endpoint",
        default=SETTINGS_DEFAULTS["otlp_endpoint"],
        metavar="URL",
        help="send an audit span per request (OpenTelemetry, OTLP over HTTP/protobuf) to this collector: a base "
        "URL such as http://127.0.0.1:4318 (spans go to /v1/traces) or the full traces URL (default: the "
        "standard OTEL_EXPORTER_OTLP_TRACES_ENDPOINT / OTEL_EXPORTER_OTLP_ENDPOINT; without them, no spans)",
    )
    telemetry.add_argument(
        "--shadow-rate",
        type=argtypes.fraction,
        default=SETTINGS_DEFAULTS["shadow_rate"],
        help="share of requests, at any temperature, compared with the full-depth model (quality guard)",
    )


def _mitigation_arguments(parser: argparse.ArgumentParser) -> None:
    """Alertmanager's webhook and what a mitigating alert does."""
    mitigation = parser.add_argument_group("alert-driven mitigation (docs/service.md)")
    mitigation.add_argument(
        "--mitigation-address",
        default=SETTINGS_DEFAULTS["mitigation_address"],
        metavar="HOST:PORT",
        help="run Alertmanager's webhook receiver on this address, apart from the API (e.g. "
        f"{LOOPBACK}:{SHIM_MITIGATION_PORT}; needs --mitigation-token-file; default: off)",
    )
    mitigation.add_argument(
        "--mitigation-token-file",
        type=Path,
        default=SETTINGS_DEFAULTS["mitigation_token_file"],
        metavar="FILE",
        help="the bearer token Alertmanager must send (its http_config authorization credentials_file; "
        "owner-only permissions, at least 32 bytes, e.g. `openssl rand -hex 32`)",
    )
    mitigation.add_argument(
        "--mitigation-requests",
        type=argtypes.positive(int),
        default=SETTINGS_DEFAULTS["mitigation_requests"],
        metavar="N",
        help="a mitigation covers at most the next N requests (default %(default)s)",
    )
    mitigation.add_argument(
        "--mitigation-minutes",
        type=argtypes.positive(float),
        default=SETTINGS_DEFAULTS["mitigation_minutes"],
        metavar="M",
        help="a mitigation lasts at most M minutes, and ends earlier when its alert resolves (default %(default)s)",
    )
    mitigation.add_argument(
        "--mitigation-full-depth",
        action="store_true",
        help="mitigated requests run at full depth (threshold 0) instead of being shadow-checked at rate 1",
    )


def add_arguments(parser: argparse.ArgumentParser) -> None:
    _model_arguments(parser)
    _skipping_arguments(parser)
    _depth_arguments(parser)
    _server_arguments(parser)
    _telemetry_arguments(parser)
    _mitigation_arguments(parser)


def settings_from_arguments(args: argparse.Namespace) -> ServeSettings:
    """The flags as ServeSettings (one flag per field); no --model means the embedded demo model."""
    values = {f.name: getattr(args, f.name) for f in dataclasses.fields(ServeSettings)}
    if args.model_dir is None:
        values.update(model_dir=DEMO_MODEL_DIR, model_name=args.model_name or DEMO_MODEL_NAME)
    return ServeSettings(**values)


def profile_runaway_fraction(settings: ServeSettings, profiles_dir: Path | None = None) -> tuple[float, str] | None:
    """The served model's request runaway cut-off from its profile, and the profile's path; None when
    alerts/profiles has no profile for the model (or cannot be read). The model name is the one the
    service will report: --model-name, else the checkpoint folder's name."""
    from alerts.profile_file import PROFILES_DIR, ProfileError, load_profile

    model_name = settings.model_name or Path(settings.model_dir).resolve().name
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
    # layerwatch_cli/main.py set that up before importing this.

    import uvicorn

    from inference_shim.runtime.checkpoint import CheckpointError
    from inference_shim.runtime.gates import GateFileError
    from inference_shim.runtime.model import CompileError
    from inference_shim.service.app import create_app
    from inference_shim.service.http_protocol import BoundedH11Protocol, ConnectionRefusals, fit_open_files
    from inference_shim.service.server import ShimServer
    from inference_shim.service.shim import ShimService

    settings = settings_from_arguments(args)
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
        api = reserve((args.host, args.port), "the API", "--host/--port")
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
    limits = HTTPLimits(args.max_header_bytes, args.header_timeout_seconds, fit_open_files(args.max_connections))
    config = uvicorn.Config(
        create_app(service),
        host=args.host,
        port=args.port,
        log_level=args.log_level,
        timeout_graceful_shutdown=5,
        http=BoundedH11Protocol.bounded(limits, ConnectionRefusals(service.registry, service.model_name)),
        h11_max_incomplete_event_size=limits.max_head_bytes,
    )
    # From here the server answers SIGTERM and SIGINT with a drain (its own handlers, which restore
    # these defaults when it is done, and then raise the signal again to exit by it).
    for signum, default in ((signal.SIGTERM, signal.SIG_DFL), (signal.SIGINT, signal.default_int_handler)):
        if signal.getsignal(signum) is not signal.SIG_IGN:
            signal.signal(signum, default)
    # uvicorn listens on it once the service has started (and, given a socket, does not log where)
    try:
        ShimServer(config, service).run(sockets=[api])
    except KeyboardInterrupt:  # uvicorn re-raises the SIGINT it drained on: exit by it, as SIGTERM exits,
        signal.signal(signal.SIGINT, signal.SIG_DFL)  # not with a traceback and status 1
        os.kill(os.getpid(), signal.SIGINT)
    return 0
