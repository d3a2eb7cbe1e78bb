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
from layerwatch.settings import changed_from_default, setting
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
        help="serve at full depth without gates, before any are trained: no gate file is read, every layer runs "
        "for every token, no gate frames or trace lines are written (nothing scores a layer) and "
        'layerwatch_model_info says gates_sha256="none" (docs/service.md, "Serving without gates"); the flags '
        "that need gates are refused with it",
    )
    reset_gates: bool = setting(
        False,
        help="serve freshly initialised gates instead of the gate file: simulates the 'gate "
        "weights overwritten' incident (layerwatch_model_info's gates_sha256 changes)",
    )
    static_gates: bool = setting(  # runtime/static_gates.py
        False,
        help="serve each layer's gate as a constant at its healthy mean score (measured from the gate "
        "file at start-up): the same layers are skipped for every token, a static-pruning drill "
        "(layerwatch_model_info's gates_sha256 changes)",
    )
    shuffle_gates: bool = setting(  # a fixed derangement
        False,
        help="serve the gate file's gates on the wrong layers (gate l gets layer (l + L/2) mod L's "
        "weights): a drill for gates that no longer track how much their layer matters "
        "(layerwatch_model_info's gates_sha256 changes; LayerwatchGateMiscalibrated should page)",
    )
    scramble_gates: bool = setting(  # runtime/gates.py
        False,
        help="serve each gate on its own layer but reading a permuted hidden state (feature j from feature "
        "(j + d/2) mod d; the same weights and biases): a drill for gates that react to every token, but to "
        "the wrong features (layerwatch_model_info's gates_sha256 changes; LayerwatchGateMiscalibrated should page)",
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
        help="check the gate file for a replacement this often: a complete, valid one is swapped in "
        "between decode steps, anything else is rejected and the loaded gates keep serving "
        "(0: never; else at least 0.1; default %(default)s)",
    )
    device: str = setting("cpu", help="torch device: cpu, cuda, cuda:1, ...")
    dtype: str = setting(
        "float32",
        choices=tuple(DTYPES),
        help="the weights' and activations' dtype: float32, or bfloat16 (half the bytes a step reads); "
        'float16 is refused on the CPU, slow there (docs/model.md, "Weights in low precision"; default %(default)s)',
    )
    quantization: str = setting(  # runtime/quantization.py
        QUANTIZATIONS[0],
        choices=QUANTIZATIONS,
        help="quantize the projections and the LM head at load time, weight-only, on torch's CPU kernels: int8 "
        "(per output channel) or int4 (per group of 32 inputs, as GGUF's Q4_1); the embedding table, norms and "
        'gates keep --dtype (docs/model.md, "Weights in low precision"; default %(default)s)',
    )
    compile: bool = setting(  # Transformer.compile_layers
        False,
        help="torch.compile each layer's attention and FFN bodies at start-up (the skip decision stays "
        "eager: skipped layers still do not run); docs/performance.md has what it buys",
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
        help="consecutive tokens below the threshold before a layer is skipped; under the ewma rule, the "
        "decode steps a sequence runs full depth before its first skip (default: the gate file's)",
    )
    skip_rule: str | None = setting(
        None,
        choices=SKIP_RULES,
        help="streak: skip a layer after --patience consecutive scores below the threshold; ewma: skip "
        "while the moving average of its scores is below the threshold (default: the gate file's)",
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
        help="how a batch runs the layers its rows want: auto, row by row only where this device does "
        "that faster than the whole batch (measured at start), whole (or by --batch-consensus) otherwise; "
        'rows: row by row always; batch: whole layers only (docs/model.md, "Depth execution")',
    )
    batch_consensus: float | None = setting(  # None: off
        DEFAULT_VOTE,
        type=argtypes.share_or_off,
        metavar="Q|off",
        help="where a layer runs whole, run it for every row when at least a share Q of the rows want it "
        f"and for none but the full-depth rows otherwise; off: for every row (default: {DEFAULT_VOTE:g})",
    )
    kv_policy: str = setting(
        KV_POLICIES[0],
        choices=KV_POLICIES,
        help="what the KV cache holds for a skipped layer: K/V projected from its input, or "
        "nothing (the position is left out of that layer's attention)",
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
        help="requests that may wait for a batch slot (being read, tokenized or queued); beyond that, new "
        "requests get 429 with Retry-After (default %(default)s)",
    )
    # Under the orchestrator's grace period (Kubernetes: 30 s), so that the cut-off answers still go out.
    drain_timeout_seconds: float = setting(
        25.0,
        type=float,
        metavar="S",
        help="on SIGTERM, stop admitting (503) and give in-flight requests this long to finish before "
        "cutting them off; keep it under the orchestrator's kill grace period (default %(default)s)",
    )
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
        help="a request's line and headers must arrive within this many seconds of the connection opening "
        "(or of its previous answer), else 408 (slow clients; default %(default)s)",
    )
    max_connections: int = setting(
        HTTPLimits.max_connections,
        type=argtypes.positive(int),
        metavar="N",
        help="open connections at most: one more closes the one slowest to send its request or to take its "
        "answer, else the one idle longest, or gets 503 when every connection has a request in (default %(default)s)",
    )
    send_timeout_seconds: float = setting(
        HTTPLimits.send_timeout,
        type=argtypes.positive(float),
        metavar="S",
        help="a connection whose client takes none of its answer for this many seconds is closed, and a "
        "generation still running for it cancelled (clients that stop reading; default %(default)s)",
    )
    allow_debug: bool = setting(
        False, help="honour the x-layerwatch-debug request header (returns per-token layer activity)"
    )
    refuse_special_tokens_in_messages: bool = setting(
        False,
        help="answer 400 to a chat whose message text holds a special token's text (<|im_end|>, </s>, ...), which "
        "would be read as the control token and could forge a turn; off: tokenized as such, as vLLM and "
        "transformers do (docs/security.md)",
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
        help="authenticate gate frames with the key in FILE (the exporter's --frame-key-file; "
        "owner-only permissions, at least 32 bytes, e.g. `openssl rand -hex 32`; default: untagged frames)",
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
        help="a request skipping more than this share of its decode layer evaluations is runaway: "
        "the layers it skipped are counted (layerwatch_request_runaway_layer_skips_total); a bucket edge "
        "of layerwatch_request_skip_fraction (default: request_tail.runaway_skip_fraction of the served "
        f"model's profile in layerwatch/alerts/profiles, else {DEFAULT_REQUEST_RUNAWAY_SKIP_FRACTION})",
    )
    # A base URL (/v1/traces is appended) or a traces URL with its path; None: the standard
    # OTEL_EXPORTER_OTLP_* variables decide, and without them spans are off (shim.resolve_otlp_endpoint).
    otlp_endpoint: str | None = setting(
        None,
        metavar="URL",
        help="send an audit span per request (OpenTelemetry, OTLP over HTTP/protobuf) to this collector: a base "
        "URL such as http://127.0.0.1:4318 (spans go to /v1/traces) or the full traces URL (default: the "
        "standard OTEL_EXPORTER_OTLP_TRACES_ENDPOINT / OTEL_EXPORTER_OTLP_ENDPOINT; without them, no spans)",
    )
    shadow_rate: float = setting(
        0.0,
        type=argtypes.fraction,
        help="share of requests, at any temperature, compared with the full-depth model (quality guard)",
    )


@dataclass(frozen=True, kw_only=True)
class AlertMitigationSettings:
    """Alertmanager's webhook receiver on its own listener, off unless an address is given (then the
    bearer token file is required), and what a mitigating alert does (service/mitigation.py)."""

    mitigation_address: str = setting(
        "",
        metavar="HOST:PORT",
        help="run Alertmanager's webhook receiver on this address, apart from the API (e.g. "
        f"{LOOPBACK}:{SHIM_MITIGATION_PORT}; needs --mitigation-token-file; default: off)",
    )
    mitigation_token_file: Path | None = setting(
        None,
        type=Path,
        metavar="FILE",
        help="the bearer token Alertmanager must send (its http_config authorization credentials_file; "
        "owner-only permissions, at least 32 bytes, e.g. `openssl rand -hex 32`)",
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
        help="a mitigation lasts at most M minutes, and ends earlier when its alert resolves (default %(default)s)",
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
        """At most one drill; none of the gated settings without gates; --static-gates at the gate file's policy."""
        drills = [flag for flag, on in self._drills() if on]
        if len(drills) > 1:
            raise ValueError(f"{' and '.join(drills)} exclude each other")
        if self.no_gates and (needing := changed_from_default(self, GATED_SETTINGS)):
            raise ValueError(f"--no-gates serves no gates: {', '.join(needing)} need(s) them")
        if self.static_gates and (self.threshold is not None or self.patience is not None):
            # The constants are placed either side of the gate file's own tau: served at another tau or
            # patience, the drill would no longer keep the healthy skip ratio.
            raise ValueError(
                "--static-gates measures at the gate file's threshold and patience: "
                "leave --threshold and --patience unset"
            )

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
