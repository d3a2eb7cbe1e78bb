"""Every setting of `layerwatch serve`, declared once: its type, default, flag and help (layerwatch/settings.py).

One dataclass per concern, each a group of `serve --help`: the model, the skip policy served, the depth
per request (service/depth.py's DepthSettings), the server and its limits, telemetry, alert-driven
mitigation. `ServeSettings` is all of them in one flat object (a DepthSettings too, so the depth decider
takes it as it is); layerwatch/cli/serve.py derives the flags from SERVE_GROUPS. A new serve flag is one
field here (or in DepthSettings); its LAYERWATCH_<FLAG> variable follows from the flag's name.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from layerwatch import argtypes
from layerwatch.catalog import DEFAULT_REQUEST_RUNAWAY_SKIP_FRACTION
from layerwatch.inference_shim.runtime.checkpoint import DTYPES, resolve_device
from layerwatch.inference_shim.runtime.demo_model import DEMO_MODEL_NAME
from layerwatch.inference_shim.runtime.depth_execution import DEFAULT_VOTE, DEPTH_MODES
from layerwatch.inference_shim.runtime.model import KV_POLICIES
from layerwatch.inference_shim.runtime.quantization import QUANTIZATIONS, check_precision
from layerwatch.inference_shim.service.depth import DepthSettings
from layerwatch.inference_shim.service.gate_watch import MAX_GATES_WATCH_SECONDS, MIN_GATES_WATCH_SECONDS
from layerwatch.inference_shim.service.http_protocol import HTTPLimits
from layerwatch.inference_shim.service.mitigation import MitigationSettings
from layerwatch.ports import LOOPBACK, SHIM_HTTP_PORT, SHIM_MITIGATION_PORT
from layerwatch.settings import changed_from_default, drain_timeout_setting, setting
from layerwatch.skip_policy import SKIP_RULES
from layerwatch.wire import DEFAULT_FRAMES_ADDRESS

DEFAULT_MAX_TOKENS_CAP = 512
DEFAULT_MAX_PROMPT_TOKENS = 1024
LOG_LEVELS = ("debug", "info", "warning", "error")


@dataclass(frozen=True, kw_only=True)
class ModelSettings:
    """The checkpoint, its gates (the drills, the reload watch), the device."""

    model_dir: Path = setting(  # no default: `serve` without --model serves the embedded demo model
        flag="--model",
        type=Path,
        metavar="DIR",
        help="Hugging Face checkpoint folder (default: the embedded demo model)",
    )
    gates_path: Path | None = setting(  # None: <model_dir>/gates.safetensors
        None,
        flag="--gates",
        type=Path,
        metavar="FILE",
        help="gate weights (default: DIR/gates.safetensors)",
    )
    model_name: str | None = setting(  # None: the model folder's name
        None,
        help=f"name clients use and metrics carry (default: the folder's name; {DEMO_MODEL_NAME} for the demo model)",
    )
    no_gates: bool = setting(
        False,
        help="serve at full depth without a gate file, before gates are trained; refuses the gated flags "
        '(docs/service.md, "Serving without gates")',
    )
    reset_gates: bool = setting(
        False,
        help='drill: serve freshly initialised gates instead of the gate file (docs/demo.md, "Drills")',
    )
    static_gates: bool = setting(  # runtime/static_gates.py
        False,
        help="drill: each gate a constant at its healthy mean score, the same layers skipped for every token",
    )
    shuffle_gates: bool = setting(  # a fixed derangement
        False,
        help="drill: gate l gets layer (l + L/2) mod L's weights",
    )
    scramble_gates: bool = setting(  # runtime/gates.py
        False,
        help="drill: each gate reads feature j of the hidden state from feature (j + d/2) mod d",
    )
    export_gates: Path | None = setting(
        None,
        type=Path,
        metavar="FILE",
        help="write the gates this command would serve (a drill flag's, or the gate file's) to FILE as a gate "
        "file and exit without serving: how `layerwatch demo --engine vllm` gives vLLM's plugin a drill's gates",
    )
    gates_watch_seconds: float = setting(
        5.0,
        type=float,
        metavar="S",
        help="seconds between checks for a replaced gate file, 0 (never) or 0.1 to 86400 (docs/service.md, "
        '"Gate file replaced while serving"; default %(default)s)',
    )
    device: str = setting("cpu", help="torch device: cpu, cuda, cuda:1, ...")
    dtype: str = setting(
        "float32",
        choices=tuple(DTYPES),
        help="weights' and activations' dtype; float16 is refused on the CPU (docs/model.md, \"Weights in low "
        'precision"; default %(default)s)',
    )
    quantization: str = setting(  # runtime/quantization.py
        QUANTIZATIONS[0],
        choices=QUANTIZATIONS,
        help="weight-only quantization of the projections and LM head at load, CPU kernels (docs/model.md, "
        '"Weights in low precision"; default %(default)s)',
    )
    compile: bool = setting(  # Transformer.compile_layers
        False,
        help="torch.compile each layer's attention and FFN bodies at start-up (docs/performance.md)",
    )


# The ModelSettings that `eval`, `calibrate` and the benchmarks take too (layerwatch/cli/model_arguments.py).
PRECISION_SETTINGS = ("dtype", "quantization")


@dataclass(frozen=True, kw_only=True)
class SkippingSettings:
    """The skip policy served (None: the gate file's, layerwatch/skip_policy.py), the KV policy and
    the depth execution (runtime/depth_execution.py)."""

    threshold: float | None = setting(
        None,
        type=argtypes.fraction,
        help="skip threshold on the gate entropy (default: the gate file's calibrated value)",
    )
    patience: int | None = setting(
        None,
        type=int,
        help="streak: consecutive tokens below the threshold before a skip; ewma: full-depth decode steps "
        "before the first skip (default: the gate file's)",
    )
    skip_rule: str | None = setting(
        None,
        choices=SKIP_RULES,
        help='how low scores become skips (docs/model.md, "The skip rule"; default: the gate file\'s)',
    )
    ewma_alpha: float | None = setting(
        None,
        type=argtypes.positive_fraction,
        metavar="A",
        help="the ewma rule's weight of the newest score, in (0, 1] (default: the gate file's)",
    )
    protected_layers: tuple[int, ...] | None = setting(  # None: first and last layer
        None,
        type=argtypes.layer_numbers,
        metavar="L,L,...",
        help="layers never skipped (default: the first and the last)",
    )
    # `eval` reads these two as well (layerwatch/cli/eval.py).
    depth_execution: str = setting(
        DEPTH_MODES[0],
        choices=DEPTH_MODES,
        help='how a batch runs the layers only some rows want (docs/model.md, "Depth execution")',
    )
    batch_consensus: float | None = setting(  # None: off
        DEFAULT_VOTE,
        type=argtypes.share_or_off,
        metavar="Q|off",
        help="a layer run whole runs for every row when a share of at least Q of the rows wants it, else only "
        f"for full-depth rows; off: always for every row (default: {DEFAULT_VOTE:g})",
    )
    kv_policy: str = setting(
        KV_POLICIES[0],
        choices=KV_POLICIES,
        help="a skipped layer's KV cache entry: K/V projected from its input, or none (the position left out "
        "of that layer's attention)",
    )


@dataclass(frozen=True, kw_only=True)
class ServerSettings:
    """The HTTP listener and its bounds (service/http_protocol.py), the batch and the queue, the request limits."""

    host: str = setting(LOOPBACK, type=argtypes.bind_host, help="bind address (loopback by default)")
    port: int = setting(SHIM_HTTP_PORT, type=argtypes.port, help=None)
    max_batch_size: int = setting(8, type=int, help="sequences decoded together; new requests join at step boundaries")
    max_waiting_requests: int = setting(
        32,
        type=int,
        metavar="N",
        help='requests that may wait for a batch slot, else 429 (docs/service.md, "Back-pressure"; '
        "default %(default)s)",
    )
    drain_timeout_seconds: float = drain_timeout_setting()
    max_tokens_cap: int | None = setting(  # None: DEFAULT_MAX_TOKENS_CAP, shrunk to fit the context
        None,
        type=int,
        help=f"largest max_tokens a request may ask for (default: {DEFAULT_MAX_TOKENS_CAP}, or "
        f"less to fit the model's context)",
    )
    max_prompt_tokens: int | None = setting(  # None: DEFAULT_MAX_PROMPT_TOKENS, shrunk to fit the context
        None,
        type=int,
        help=f"longest prompt accepted, in tokens (default: {DEFAULT_MAX_PROMPT_TOKENS}, or less "
        f"to fit the model's context with the cap)",
    )
    max_body_bytes: int = setting(1 << 20, type=int, help="largest request body accepted")
    body_timeout_seconds: float = setting(
        30.0, type=float, help="a request body must arrive within this many seconds, else 408 (slow clients)"
    )
    max_header_bytes: int = setting(
        HTTPLimits.max_head_bytes,
        type=argtypes.positive(int),
        metavar="N",
        help="largest request line and headers accepted, else 431 (default %(default)s)",
    )
    header_timeout_seconds: float = setting(
        HTTPLimits.head_timeout,
        type=argtypes.positive(float),
        metavar="S",
        help="seconds for a request's line and headers to arrive, else 408 (default %(default)s)",
    )
    max_connections: int = setting(
        HTTPLimits.max_connections,
        type=argtypes.positive(int),
        metavar="N",
        help='open connections at most (docs/service.md, "Connections"; default %(default)s)',
    )
    send_timeout_seconds: float = setting(
        HTTPLimits.send_timeout,
        type=argtypes.positive(float),
        metavar="S",
        help="seconds a client may take none of its answer before the connection is closed and its generation "
        "cancelled (default %(default)s)",
    )
    allow_debug: bool = setting(
        False, help="honour the x-layerwatch-debug request header (returns per-token layer activity)"
    )
    refuse_special_tokens_in_messages: bool = setting(
        False,
        help="answer 400 to a chat message holding a special token's text (<|im_end|>, ...), which could forge a "
        "turn (docs/security.md)",
    )
    log_level: str = setting("info", choices=LOG_LEVELS, help=None)


@dataclass(frozen=True, kw_only=True)
class TelemetrySettings:
    """Gate frames, traces, the request runaway cut-off, the audit trail and the shadow check."""

    exporter_address: str = setting(
        DEFAULT_FRAMES_ADDRESS, metavar="HOST:PORT", help="where gate frames go over UDP (empty: no frames)"
    )
    shim_id: str | None = setting(  # None: hostname-pid-random (layerwatch.client.default_shim_id)
        None,
        help="identifies this process in gate frames, one per process (default: hostname-pid-random, new each start)",
    )
    frame_key_file: Path | None = setting(  # gate frames tagged with this key (layerwatch/wire.py)
        None,
        type=Path,
        metavar="FILE",
        help='tag gate frames with the key in FILE (docs/wire-format.md, "Key file"; default: untagged)',
    )
    trace_file: Path | None = setting(
        None, type=Path, help="also write every decoded token's scores and skips as a JSON Lines trace"
    )
    trace_max_bytes: int = setting(100 << 20, type=int, help="stop writing the trace file at this size")
    # None: the served model's profile's, else the catalog's default (layerwatch/cli/serve.py, docs/service.md).
    request_runaway_fraction: float | None = setting(
        None,
        type=argtypes.fraction,
        metavar="F",
        help='skip fraction above which a request is runaway (docs/service.md, "Per-request skipping"; default: '
        f"the profile's request_tail.runaway_skip_fraction, else {DEFAULT_REQUEST_RUNAWAY_SKIP_FRACTION})",
    )
    # A base URL (/v1/traces is appended) or a traces URL with its path; None: the standard
    # OTEL_EXPORTER_OTLP_* variables decide, and without them spans are off (shim.resolve_otlp_endpoint).
    otlp_endpoint: str | None = setting(
        None,
        metavar="URL",
        help='OTLP/HTTP collector for audit spans, a base or traces URL (docs/service.md, "Audit trail"; '
        "default: the OTEL_EXPORTER_OTLP_* variables, else none)",
    )
    shadow_rate: float = setting(
        0.0,
        type=argtypes.fraction,
        help='share of requests compared with the full-depth model (docs/service.md, "Quality guard")',
    )


@dataclass(frozen=True, kw_only=True)
class AlertMitigationSettings:
    """Alertmanager's webhook receiver on its own listener, off unless an address is given (then the
    bearer token file is required), and what a mitigating alert does (service/mitigation.py)."""

    mitigation_address: str = setting(
        "",
        metavar="HOST:PORT",
        help=f"Alertmanager's webhook receiver address (e.g. {LOOPBACK}:{SHIM_MITIGATION_PORT}; needs "
        "--mitigation-token-file; default: off)",
    )
    mitigation_token_file: Path | None = setting(
        None,
        type=Path,
        metavar="FILE",
        help="the bearer token Alertmanager must send, a key file as --frame-key-file's",
    )
    mitigation_requests: int = setting(
        100,
        type=argtypes.positive(int),
        metavar="N",
        help="a mitigation covers at most the next N requests (default %(default)s)",
    )
    mitigation_minutes: float = setting(
        30.0,
        type=argtypes.positive(float),
        metavar="M",
        help="a mitigation lasts at most M minutes (default %(default)s)",
    )
    mitigation_full_depth: bool = setting(
        False,
        help="mitigated requests run at full depth (threshold 0) instead of being shadow-checked at rate 1",
    )


@dataclass(frozen=True, kw_only=True)
class ServeSettings(
    AlertMitigationSettings, TelemetrySettings, ServerSettings, DepthSettings, SkippingSettings, ModelSettings
):
    """Every serve setting; its fields in the order of SERVE_GROUPS (a dataclass lists its bases' fields
    from the last base to the first)."""

    def check(self) -> None:
        """Refuse what cannot be served (ValueError naming the flag), each setting checked here once:
        `ShimService.load` calls it before the model loads (seconds to minutes), so that a bad setting
        fails at once. What needs the model (protected layers, limits against its context, the KV cache
        against the device's memory) is checked as the service is built."""
        check_precision(resolve_device(self.device), DTYPES[self._dtype_served()], self.quantization)
        self._check_gate_settings()
        if self.max_batch_size < 1:
            raise ValueError(f"--max-batch-size must be >= 1, got {self.max_batch_size}")
        if not self.drain_timeout_seconds >= 0:
            raise ValueError(f"--drain-timeout-seconds must be >= 0, got {self.drain_timeout_seconds}")
        super().check()  # DepthSettings'
        self.mitigation()
        check_gates_watch_seconds(self.gates_watch_seconds)

    def _dtype_served(self) -> str:
        if self.dtype not in DTYPES:
            raise ValueError(f"--dtype must be one of {', '.join(DTYPES)}, got {self.dtype!r}")
        return self.dtype

    def _check_gate_settings(self) -> None:
        """At most one drill; none of the gated settings without gates; --static-gates at the gate file's patience."""
        drills = [flag for flag, on in self._drills() if on]
        if len(drills) > 1:
            raise ValueError(f"{' and '.join(drills)} exclude each other")
        if self.no_gates and (needing := changed_from_default(self, GATED_SETTINGS)):
            raise ValueError(f"--no-gates serves no gates: {', '.join(needing)} need(s) them")
        if self.static_gates and self.patience is not None:
            # The constants are placed either side of the served tau after a decode at the gate file's
            # patience: served at another patience, the drill would no longer keep the healthy skip ratio.
            raise ValueError("--static-gates measures at the gate file's patience: leave --patience unset")

    def _drills(self) -> tuple[tuple[str, bool], ...]:
        return (
            ("--reset-gates", self.reset_gates),
            ("--static-gates", self.static_gates),
            ("--shuffle-gates", self.shuffle_gates),
            ("--scramble-gates", self.scramble_gates),
        )

    @property
    def drill(self) -> bool:
        """A drill's gates are served: the gate file is not watched for replacements."""
        return any(on for _, on in self._drills())

    def mitigation(self) -> MitigationSettings:
        """The mitigations' settings (MitigationSettings checks them)."""
        return MitigationSettings(
            self.mitigation_requests, self.mitigation_minutes * 60, self.mitigation_full_depth, self.shadow_rate
        )


def check_gates_watch_seconds(seconds: float) -> None:
    # A tiny interval (or NaN, which waits not at all) would make an idle shim spin on stat().
    if not (seconds == 0 or MIN_GATES_WATCH_SECONDS <= seconds <= MAX_GATES_WATCH_SECONDS):
        raise ValueError(
            f"--gates-watch-seconds must be 0 (never) or a number from {MIN_GATES_WATCH_SECONDS} to "
            f"{MAX_GATES_WATCH_SECONDS:g}, got {seconds}"
        )


# The settings that mean something only with gates (a gate file, a drill on it, the skip policy, what
# reads gate scores, requests asking to skip): `serve --no-gates` refuses them (shim.ShimService.load).
GATED_SETTINGS = (
    "gates_path",
    "reset_gates",
    "static_gates",
    "shuffle_gates",
    "scramble_gates",
    "export_gates",
    "threshold",
    "patience",
    "skip_rule",
    "ewma_alpha",
    "protected_layers",
    "depth_execution",
    "batch_consensus",
    "request_threshold_range",
    "long_prompt_tokens",
    "complexity_cutoff",
    "rollout_levels",
    "trace_file",
    "shadow_rate",
)


# `serve --help`'s groups, in order: each concern's flags under its title.
SERVE_GROUPS: tuple[tuple[type, str], ...] = (
    (ModelSettings, "model"),
    (SkippingSettings, "skipping"),
    (DepthSettings, 'depth per request (docs/service.md, "Depth per request")'),
    (ServerSettings, "server"),
    (TelemetrySettings, "telemetry"),
    (AlertMitigationSettings, "alert-driven mitigation (docs/service.md)"),
)
