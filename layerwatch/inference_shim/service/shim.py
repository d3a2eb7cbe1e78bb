"""Everything `layerwatch serve` runs, wired together: model, engine thread, telemetry, metrics.

`ShimService.load(settings)` loads the checkpoint and gates and builds the parts; `app.py` puts
the HTTP API on top. Nothing here touches the global Prometheus registry: the service owns one.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import socket
from collections.abc import Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING
from urllib.parse import urlsplit

from prometheus_client import CollectorRegistry

from layerwatch.catalog import DEFAULT_REQUEST_RUNAWAY_SKIP_FRACTION
from layerwatch.client import GateFrameSender, default_shim_id
from layerwatch.gate_importance import LayerSignalStats
from layerwatch.inference_shim.runtime.checkpoint import (
    DTYPES,
    LoadedCheckpoint,
    device_memory_bytes,
    load_checkpoint,
)
from layerwatch.inference_shim.runtime.demo_model import served_model_name
from layerwatch.inference_shim.runtime.depth_execution import (
    DepthExecution,
    DepthExecutionConfig,
    default_depth_execution,
)
from layerwatch.inference_shim.runtime.engine import GenerationEngine, StepHook, scoring_slots
from layerwatch.inference_shim.runtime.gates import (
    LoadedGates,
    gates_path_for,
    load_gates,
    reset_gates,
    save_gates,
    scramble_gates,
    shuffle_gates,
)
from layerwatch.inference_shim.runtime.model import KVCache, Transformer
from layerwatch.inference_shim.runtime.static_gates import static_gates
from layerwatch.inference_shim.service.admission import Admission
from layerwatch.inference_shim.service.completions import GenerationParts
from layerwatch.inference_shim.service.depth import DepthDecider, DepthMetrics
from layerwatch.inference_shim.service.engine_worker import EngineWorker
from layerwatch.inference_shim.service.gate_watch import (
    GateFileWatcher,
)
from layerwatch.inference_shim.service.layer_signals import LayerSignalsCollector
from layerwatch.inference_shim.service.metrics import (
    AuditCollector,
    AuditSpanCounts,
    DecodeStats,
    DecodeStatsCollector,
    GateReloadMetrics,
    ModelInfo,
    ModelInfoCollector,
    RequestMetrics,
    RequestQueueCollector,
    ShadowMetrics,
    isolated,
)
from layerwatch.inference_shim.service.mitigation import MitigationMetrics, Mitigations, PagingEvent
from layerwatch.inference_shim.service.mitigation_receiver import WEBHOOK_PATH, MitigationReceiver, reserve
from layerwatch.inference_shim.service.power import NvmlCollector, RaplCollector
from layerwatch.inference_shim.service.readiness import Readiness
from layerwatch.inference_shim.service.settings import (
    DEFAULT_MAX_PROMPT_TOKENS,
    DEFAULT_MAX_TOKENS_CAP,
    ServeSettings,
)
from layerwatch.inference_shim.service.shadow import ShadowChecker
from layerwatch.inference_shim.service.telemetry import FrameSenderCollector, StepTelemetry, TraceCollector
from layerwatch.ports import http_url
from layerwatch.prometheus import IsolatedCollectors
from layerwatch.secret_file import RotatingSecret
from layerwatch.skip_policy import POLICY_FIELDS, SkipPolicyConfig
from layerwatch.trace import TraceWriter
from layerwatch.wire import load_frame_key, parse_address, unprintable

if TYPE_CHECKING:
    from opentelemetry.sdk.trace.export import SpanExporter

    from layerwatch.inference_shim.service.audit import AuditTrail

log = logging.getLogger(__name__)

RESET_GATES_SEED = 0
# layerwatch_model_info's gates_sha256 under --no-gates: no gate weights are served.
NO_GATES_SHA256 = "none"
# The policy served under --no-gates: nothing scores strictly below 0, so no layer is ever skipped.
FULL_DEPTH_POLICY = SkipPolicyConfig(threshold=0.0)
PROBE_TEXT = "ready"
GATE_SWAP_TIMEOUT_SECONDS = 60.0  # the engine takes new gates at its next step boundary
OTLP_PROTOCOL = "http/protobuf"  # the one OTLP transport the audit trail speaks
OTLP_TRACES_PATH = "v1/traces"


def gates_file(settings: ServeSettings) -> Path:
    return gates_path_for(settings.model_dir, settings.gates_path)


@dataclass(frozen=True)
class MitigationListener:
    """The mitigation receiver's socket, bound (mitigation_receiver.reserve), and its bearer token."""

    socket: socket.socket
    token: RotatingSecret


def _mitigation_listener(settings: ServeSettings) -> MitigationListener | None:
    """The receiver's token read and its address bound when it is on, before the model loads, so
    that a bad setting or a taken port fails at once (the socket is closed if the start fails later)."""
    if not settings.mitigation_address:
        return None
    address = parse_address(settings.mitigation_address, listening=True)
    if settings.mitigation_token_file is None:
        raise ValueError("--mitigation-address needs --mitigation-token-file: the receiver never runs unauthenticated")
    token = RotatingSecret(settings.mitigation_token_file, "mitigation token file", header_value=True)
    return MitigationListener(reserve(address), token)


def policy_from_file(settings: ServeSettings) -> tuple[str, ...]:
    """The skip policy settings served as the gate file says: those not set on the command line
    (ServeSettings names them as the gate file does)."""
    return tuple(name for name in POLICY_FIELDS if getattr(settings, name) is None)


@dataclass(frozen=True)
class Limits:
    max_prompt_tokens: int
    max_tokens_cap: int
    max_body_bytes: int
    body_timeout_seconds: float
    # A longer prompt has more than max_prompt_tokens tokens whatever it says: refused untokenized.
    # None: the tokenizer gives no such bound (Tokenizer.max_chars_per_token).
    max_prompt_chars: int | None = None

    @property
    def max_model_len(self) -> int:
        """The longest sequence served, prompt and generation (vLLM's name; the engine's cache length)."""
        return self.max_prompt_tokens + self.max_tokens_cap


def resolve_otlp_endpoint(endpoint: str | None, environ: Mapping[str, str]) -> str | None:
    """The OTLP/HTTP traces URL of the audit trail; None: spans off, the default.

    `endpoint` (--otlp-endpoint) first: a base URL such as http://collector:4318 gets /v1/traces,
    a URL with a path is used as it is. Else the standard variables, as OTel SDKs read them:
    OTEL_EXPORTER_OTLP_TRACES_ENDPOINT as it is, else OTEL_EXPORTER_OTLP_ENDPOINT + /v1/traces.
    OTEL_SDK_DISABLED=true turns spans off whatever is set. Spans travel as OTLP over HTTP with
    protobuf only: another OTEL_EXPORTER_OTLP_[TRACES_]PROTOCOL, or a URL that is not http(s), is
    refused rather than silently not exported.
    """
    if environ.get("OTEL_SDK_DISABLED", "").strip().lower() == "true":
        if endpoint:
            log.warning("OTEL_SDK_DISABLED=true: no audit spans, although --otlp-endpoint is set")
        return None
    if endpoint:
        source, url = "--otlp-endpoint", endpoint if urlsplit(endpoint).path.strip("/") else _traces_url(endpoint)
    elif environ.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT"):
        source, url = "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", environ["OTEL_EXPORTER_OTLP_TRACES_ENDPOINT"]
    elif environ.get("OTEL_EXPORTER_OTLP_ENDPOINT"):
        source, url = "OTEL_EXPORTER_OTLP_ENDPOINT", _traces_url(environ["OTEL_EXPORTER_OTLP_ENDPOINT"])
    else:
        return None
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ValueError(f"{source} must be an http:// or https:// URL with a host, got {url!r}")
    for variable in ("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL", "OTEL_EXPORTER_OTLP_PROTOCOL"):
        protocol = environ.get(variable)
        if protocol and protocol.strip() != OTLP_PROTOCOL:
            raise ValueError(f"{variable}={protocol}: audit spans are sent as OTLP {OTLP_PROTOCOL} only")
    return url


def _traces_url(base: str) -> str:
    return f"{base.rstrip('/')}/{OTLP_TRACES_PATH}"


def resolve_limits(settings: ServeSettings, context: int, chars_per_token: int | None = None) -> Limits:
    """Fit prompt + generation into the model's context (`max_position_embeddings`).

    Unset limits default to DEFAULT_MAX_TOKENS_CAP / DEFAULT_MAX_PROMPT_TOKENS, shrunk to fit;
    limits that were set explicitly and do not fit are refused. `chars_per_token` (the tokenizer's
    most characters per token) turns the prompt limit into a size limit checked before tokenizing.
    """
    cap, prompt = settings.max_tokens_cap, settings.max_prompt_tokens
    if any(v is not None and v < 1 for v in (cap, prompt)) or settings.max_body_bytes < 1:
        raise ValueError("--max-tokens-cap, --max-prompt-tokens and --max-body-bytes must be positive")
    if not settings.body_timeout_seconds > 0:
        raise ValueError("--body-timeout-seconds must be positive")
    for flag, value in (("--max-tokens-cap", cap), ("--max-prompt-tokens", prompt)):
        if value is not None and value >= context:
            raise ValueError(f"{flag} {value} does not fit the model's {context}-token context")
    if cap is None:
        cap = min(DEFAULT_MAX_TOKENS_CAP, context // 2 if prompt is None else context - prompt)
    if prompt is None:
        prompt = min(DEFAULT_MAX_PROMPT_TOKENS, context - cap)
    if prompt + cap > context:
        raise ValueError(
            f"--max-prompt-tokens {prompt} + --max-tokens-cap {cap} exceed the model's {context}-token context"
        )
    max_chars = None if chars_per_token is None else prompt * chars_per_token
    return Limits(prompt, cap, settings.max_body_bytes, settings.body_timeout_seconds, max_chars)


def _load_model(settings: ServeSettings) -> tuple[LoadedCheckpoint, LoadedGates | None]:
    """The checkpoint and the gates it serves (a drill's, when one is asked for; None: --no-gates)."""
    log.info(
        "loading the model %s (%s, %s, quantization %s)",
        settings.model_dir,
        settings.device,
        settings.dtype,
        settings.quantization,
    )
    checkpoint = load_checkpoint(
        settings.model_dir, device=settings.device, dtype=DTYPES[settings.dtype], quantization=settings.quantization
    )
    if settings.compile:
        checkpoint.model.compile_layers()
    if settings.no_gates:
        log.warning(
            "serving at full depth without gates (--no-gates): every layer runs for every token; no gate "
            'frames, layerwatch_model_info{gates_sha256="%s"}',
            NO_GATES_SHA256,
        )
        return checkpoint, None
    if settings.reset_gates:
        gates = reset_gates(checkpoint.model, seed=RESET_GATES_SEED)
        log.warning("serving freshly initialised gates (--reset-gates), gates_sha256=%s", gates.sha256)
    elif settings.static_gates:
        healthy = load_gates(gates_file(settings), checkpoint.model)
        # Decoded in a thread of its own, as the engine worker decodes: called from the main thread,
        # torch's CPU kernels took 18-45 s for this measurement against 0.5 s in a thread, on 2 CPU
        # cores shared with other jobs. Measured by `layerwatch serve --static-gates`:
        # the time from its "loading the model" log line to "serving constant gates" (model load
        # included: 2.0-2.8 s with the thread, at load average 1.8).
        with ThreadPoolExecutor(max_workers=1, thread_name_prefix="static-gates") as pool:
            drill = pool.submit(
                static_gates,
                checkpoint.model,
                checkpoint.tokenizer,
                healthy,
                protected_layers=settings.protected_layers,
                kv_policy=settings.kv_policy,
                threshold=settings.threshold,
            ).result()
        gates = drill.gates
        log.warning(
            "serving constant gates (--static-gates): layers %s skipped for every token; scores %s; gates_sha256=%s",
            list(drill.static_layers),
            " ".join(f"{layer}:{c:.3f}" for layer, c in enumerate(drill.constants.tolist())),
            gates.sha256,
        )
    else:
        gates = load_gates(gates_file(settings), checkpoint.model)
    if settings.shuffle_gates:
        gates = shuffle_gates(gates)
        log.warning("serving the gates on the wrong layers (--shuffle-gates), gates_sha256=%s", gates.sha256)
    if settings.scramble_gates:
        gates = scramble_gates(gates)
        log.warning(
            "serving the gates reading permuted hidden-state features (--scramble-gates), gates_sha256=%s", gates.sha256
        )
    return checkpoint, gates


def export_gates(settings: ServeSettings) -> str:
    """Write the gates `settings` serve (a drill's, when one is asked for) to `settings.export_gates`;
    returns their sha256. The drills' transforms are the ones `serve` applies: one definition of each."""
    assert settings.export_gates is not None
    settings.check()
    _, gates = _load_model(settings)
    assert gates is not None  # --no-gates refuses --export-gates (GATED_SETTINGS)
    return save_gates(settings.export_gates, gates.gates, gates.metadata)


def _check_kv_cache_fits(checkpoint: LoadedCheckpoint, batch_size: int, max_seq_len: int) -> None:
    """ValueError when the engine's KV cache would not fit in all of the device's memory: found here,
    not as an allocation failure with a traceback once the server starts (--max-batch-size 1000000)."""
    weight = checkpoint.model.embed_tokens.weight  # what the engine sizes its cache by
    needed = KVCache.bytes_needed(checkpoint.config, batch_size, max_seq_len, weight.dtype)
    available = device_memory_bytes(weight.device)
    if needed > available:
        raise ValueError(
            f"--max-batch-size {batch_size}: the KV cache for {batch_size} sequences of {max_seq_len} tokens needs "
            f"{needed / 2**30:,.1f} GiB, more than all {available / 2**30:,.1f} GiB of {weight.device}"
        )


def checked_model_name(checkpoint: LoadedCheckpoint, settings: ServeSettings) -> str:
    """The name served and carried by the metrics and frames: printable, as the exporter would refuse
    its frames otherwise."""
    name = served_model_name(checkpoint.path, settings.model_name)
    if (character := unprintable(name)) is not None:
        raise ValueError(f"--model-name {name!r} holds {character}, which is not printable")
    return name


def served_limits(settings: ServeSettings, checkpoint: LoadedCheckpoint) -> Limits:
    limits = resolve_limits(
        settings, checkpoint.config.max_position_embeddings, checkpoint.tokenizer.max_chars_per_token()
    )
    if limits.max_prompt_chars is None:
        log.warning(
            "this tokenizer may drop or merge characters: prompts cannot be refused by size and are "
            "tokenized in full (up to --max-body-bytes) before the --max-prompt-tokens check"
        )
    return limits


def served_policy(gates: LoadedGates | None, settings: ServeSettings, num_layers: int) -> SkipPolicyConfig:
    """The skip policy served: what the command line leaves unset (None) the gate file says
    (SkipPolicyConfig.recorded); out-of-range protected layers are refused here, at start-up."""
    if gates is None:
        return FULL_DEPTH_POLICY
    chosen = {name: getattr(settings, name) for name in POLICY_FIELDS}
    policy = gates.metadata.policy(**chosen, protected_layers=settings.protected_layers)
    policy.protected(num_layers)
    return policy


def served_depth_execution(model: Transformer, settings: ServeSettings, *, gated: bool) -> DepthExecution:
    """Shared by every engine the worker builds: the measured costs hold for the model, not an engine.
    Without gates nothing is skipped: whole layers, with no start-up measurement of the row-partial
    path (9 s for SmolLM2-135M's 30 layers on a loaded CPU core)."""
    config = (
        DepthExecutionConfig(settings.depth_execution, settings.batch_consensus)
        if gated
        else DepthExecutionConfig("batch")
    )
    return default_depth_execution(model, settings.kv_policy, config)


def frame_sender(
    settings: ServeSettings, model_name: str, num_layers: int, threshold: float, shim_id: str, key: bytes | None
) -> GateFrameSender | None:
    """Where each decode step's gate frame goes (None: no frames)."""
    if not settings.exporter_address:
        return None
    try:
        return GateFrameSender(settings.exporter_address, model_name, num_layers, threshold, shim_id=shim_id, key=key)
    except ValueError as exc:  # its message names the address or the shim id it refused
        raise ValueError(f"gate frames (--exporter-address, --shim-id): {exc}") from None


class ShimService:
    def __init__(
        self,
        checkpoint: LoadedCheckpoint,
        gates: LoadedGates | None,
        settings: ServeSettings,
        frame_key: bytes | None,
        registry: CollectorRegistry | None = None,
        mitigation: MitigationListener | None = None,
        span_exporter: SpanExporter | None = None,
    ) -> None:
        """Each part built from `settings` (checked by ServeSettings.check) and the model; what cannot be
        served with this model (protected layers, limits, the KV cache) is refused before anything starts.
        `gates` None serves the model at full depth without gates (--no-gates): no scores, so no gate
        frames and no complexity pre-check. `settings.otlp_endpoint` is the resolved traces URL (None:
        spans off); a `span_exporter` turns spans on with that exporter instead (tests: the SDK's
        in-memory exporter)."""
        gated = gates is not None
        num_layers = checkpoint.config.num_layers
        # The model and how it is served.
        checkpoint.model.attach_gates(gates.gates if gates is not None else None)
        self.model, self.tokenizer = checkpoint.model, checkpoint.tokenizer
        self.model_name = checked_model_name(checkpoint, settings)
        self.allow_debug = settings.allow_debug
        refuse = settings.refuse_special_tokens_in_messages
        self.refused_in_messages = self.tokenizer.special_token_pattern() if refuse else None
        self.limits = served_limits(settings, checkpoint)
        self.policy = served_policy(gates, settings, num_layers)
        self.kv_policy = settings.kv_policy
        self.depth_execution = served_depth_execution(self.model, settings, gated=gated)
        self.max_batch_size = settings.max_batch_size
        _check_kv_cache_fits(checkpoint, settings.max_batch_size, self.max_seq_len)
        self.drain_timeout_seconds = settings.drain_timeout_seconds
        # Metrics: the service's own registry.
        self.registry = registry if registry is not None else CollectorRegistry()
        self.model_info = self._model_info(settings, NO_GATES_SHA256 if gates is None else gates.sha256)
        self.request_metrics = self._request_metrics(settings, num_layers)
        self.decode_stats = DecodeStats(num_layers)
        shadow_metrics = ShadowMetrics(self.registry, self.model_name)  # exposed (at 0) even without the checker
        # Where the decode steps go, and the audit trail.
        shim_id = settings.shim_id or default_shim_id()
        threshold = self.policy.threshold
        self.sender = (
            frame_sender(settings, self.model_name, num_layers, threshold, shim_id, frame_key) if gated else None
        )
        self.trace = (
            TraceWriter(settings.trace_file, settings.trace_max_bytes, threshold=threshold)
            if settings.trace_file
            else None
        )
        self.audit_spans = AuditSpanCounts()
        self.audit = self._audit_trail(settings.otlp_endpoint, span_exporter, shim_id)
        self.layer_signals = LayerSignalStats(num_layers)
        # The worker is created below; the admission reads its running count only when asked.
        self.admission = Admission(
            settings.max_batch_size,
            settings.max_waiting_requests,
            lambda: self.worker.running,
            max_scored_tokens=scoring_slots(settings.max_batch_size) * self.limits.max_prompt_tokens,
        )
        self.registry.register(self._scrape_time_collectors())
        # Alert-driven mitigation and the depth each request runs at.
        self.mitigations = Mitigations(
            self.model_name,
            settings.mitigation(),
            MitigationMetrics(self.registry, self.model_name),  # exposed (at 0) even without the receiver
        )
        self.mitigation_receiver = (
            MitigationReceiver(mitigation.socket, self.mitigations, mitigation.token.current)
            if mitigation is not None
            else None
        )
        self.depth = DepthDecider(
            settings, threshold, self.policy.skippable(num_layers), DepthMetrics(self.registry, self.model_name)
        )
        if settings.rollout_levels:
            self.mitigations.on_paging.append(self._demote_rollout)
        # The engine's thread and what reads it.
        self.worker = EngineWorker(
            self._engine_factory,
            self.tokenizer.encode(PROBE_TEXT),
            StepTelemetry(self.model_name, self.decode_stats, self.sender, self.trace),
            self._shadow_checker(settings, shadow_metrics),
            self.depth if gated else None,
            gated=gated,
        )
        self.readiness = Readiness(self.worker)
        self.gate_watcher = None if gates is None else self._gate_watcher(settings, gates)
        self.generation_parts = GenerationParts(
            self.worker,
            self.depth,
            self.request_metrics,
            self.admission,
            self.mitigations,
            self.tokenizer,
            lambda: self.gates_sha256,
        )

    def _model_info(self, settings: ServeSettings, gates_sha256: str) -> ModelInfo:
        return ModelInfo(
            self.model_name,
            self.model.config.num_layers,
            settings.dtype,  # what _load_model loaded the checkpoint at
            settings.quantization,
            self.policy.threshold,
            self.policy.patience,
            self.policy.skip_rule,
            self.policy.ewma_alpha,
            self.kv_policy,
            gates_sha256,
        )

    def _request_metrics(self, settings: ServeSettings, num_layers: int) -> RequestMetrics:
        runaway = settings.request_runaway_fraction
        return RequestMetrics(
            self.registry,
            self.model_name,
            num_layers,
            DEFAULT_REQUEST_RUNAWAY_SKIP_FRACTION if runaway is None else runaway,
        )

    def _scrape_time_collectors(self) -> IsolatedCollectors:
        """The custom collectors compute at scrape time (hardware readings, statistics): isolated, so
        that one failing leaves the rest of /metrics served (docs/service.md, "Metrics")."""
        return isolated(
            {
                "model_info": ModelInfoCollector(lambda: self.model_info),
                "decode_stats": DecodeStatsCollector(self.decode_stats, self.model_name),
                "frame_sender": FrameSenderCollector(self.sender, self.model_name),
                "trace": TraceCollector(self.trace, self.model_name),
                "nvml": NvmlCollector(),
                "rapl": RaplCollector(),
                "layer_signals": LayerSignalsCollector(self.layer_signals, self.model_name),
                "request_queue": RequestQueueCollector(self.admission.running, self.admission.waiting, self.model_name),
                "audit": AuditCollector(self.audit_spans, self.model_name),
            }
        )

    def _shadow_checker(self, settings: ServeSettings, metrics: ShadowMetrics) -> ShadowChecker | None:
        """A mitigation raises the shadow rate of its requests: the checker is needed even at rate 0
        when the receiver runs."""
        if not settings.shadow_rate > 0 and self.mitigation_receiver is None:
            return None
        return ShadowChecker(self.model, metrics, settings.shadow_rate, self.layer_signals)

    def _demote_rollout(self, event: PagingEvent) -> None:
        """A paging alert of this model fired: back to the previous rollout level. A resolution
        does not promote again: going back up is the operator's decision (a restart or the flag)."""
        if event.firing:
            self.depth.demote(f"{event.alertname} fired")

    @classmethod
    def load(
        cls,
        settings: ServeSettings,
        registry: CollectorRegistry | None = None,
        span_exporter: SpanExporter | None = None,
    ) -> ShimService:
        settings.check()  # before the model loads: a bad setting fails at once
        endpoint = resolve_otlp_endpoint(settings.otlp_endpoint, os.environ)
        settings = dataclasses.replace(settings, otlp_endpoint=endpoint)
        # Read before the model loads (seconds to minutes), so that a bad key file fails at once.
        frame_key = (
            load_frame_key(settings.frame_key_file) if settings.frame_key_file and settings.exporter_address else None
        )
        mitigation = _mitigation_listener(settings)
        try:
            checkpoint, gates = _load_model(settings)
            return cls(checkpoint, gates, settings, frame_key, registry, mitigation, span_exporter)
        except BaseException:
            if mitigation is not None:
                mitigation.socket.close()
            raise

    @property
    def gates_sha256(self) -> str:
        return self.model_info.gates_sha256

    def _audit_trail(self, endpoint: str | None, exporter: SpanExporter | None, shim_id: str) -> AuditTrail | None:
        if endpoint is None and exporter is None:
            return None  # spans off: the OTel SDK is not even imported
        # Imported only now: the SDK and its exporter take 0.4 s to import.
        from layerwatch.inference_shim.service.audit import AuditTrail

        if exporter is not None:
            return AuditTrail(exporter, self.audit_spans, shim_id)
        assert endpoint is not None
        log.info("audit spans: one per request, over OTLP/HTTP to %s", endpoint)
        return AuditTrail.over_otlp(endpoint, self.audit_spans, shim_id)

    def _gate_watcher(self, settings: ServeSettings, gates: LoadedGates) -> GateFileWatcher | None:
        metrics = GateReloadMetrics(self.registry, self.model_name)  # exposed (at 0) even when not watching
        if settings.drill or settings.gates_watch_seconds == 0:
            return None
        return GateFileWatcher(
            gates_file(settings),
            self.model,
            self.policy,
            policy_from_file=policy_from_file(settings),
            served_sha256=gates.sha256,
            apply=self._swap_gates,
            metrics=metrics,
            interval=settings.gates_watch_seconds,
        )

    def hangup(self) -> None:
        """SIGHUP: check the gate file now, when it is watched; serving goes on either way."""
        if self.gate_watcher is None:
            log.warning(
                "SIGHUP received and ignored: no gate file is watched (--gates-watch-seconds 0, a drill or --no-gates)"
            )
            return
        log.warning("SIGHUP received: checking the gate file %s now", self.gate_watcher.path)
        self.gate_watcher.check_now()

    def _swap_gates(self, loaded: LoadedGates) -> None:
        """Validated gates from the watcher: returns once the engine serves them."""
        swapped = self.worker.swap_gates(loaded.gates)
        # model_info follows the engine (the callback runs in its thread right after the swap), so it
        # never names gates that are not serving, even if this wait gives up.
        swapped.add_done_callback(lambda _: self._now_serving(loaded.sha256))
        swapped.result(timeout=GATE_SWAP_TIMEOUT_SECONDS)

    def _now_serving(self, gates_sha256: str) -> None:
        self.model_info = dataclasses.replace(self.model_info, gates_sha256=gates_sha256)

    @property
    def max_seq_len(self) -> int:
        return self.limits.max_model_len

    def _engine_factory(self, step_hook: StepHook) -> GenerationEngine:
        return GenerationEngine(
            self.model,
            self.tokenizer,
            model_name=self.model_name,
            policy=self.policy,
            kv_policy=self.kv_policy,
            max_batch_size=self.max_batch_size,
            max_seq_len=self.max_seq_len,
            step_hook=step_hook,
            depth=self.depth_execution,
        )

    def start(self) -> None:
        self.worker.start()
        if self.gate_watcher is not None:
            self.gate_watcher.start()
        if self.mitigation_receiver is not None:
            self.mitigation_receiver.start()
            log.info("mitigation webhook receiver on %s", http_url(self.mitigation_receiver.address, WEBHOOK_PATH))

    def stop(self) -> None:
        if self.mitigation_receiver is not None:
            self.mitigation_receiver.stop()
        self.mitigations.shut_down()  # a log audit must not see mitigations that never ended
        if self.gate_watcher is not None:
            self.gate_watcher.stop()
        self.worker.stop()
        if self.audit is not None:
            self.audit.shutdown()  # after the engine: its last shadow spans are in the queue
        if self.sender is not None:
            self.sender.close()
        if self.trace is not None:
            try:
                self.trace.close()
            except OSError as exc:  # writes are unbuffered: nothing is lost here, and shutdown goes on
                log.error("closing trace file %s: %s", self.trace.path, exc)
