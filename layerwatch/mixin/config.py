"""Everything the generated rules, dashboards and deploy files share, in one place.

Thresholds live in the per-model profiles (layerwatch/alerts/profiles/*.yaml), and each alert's name, severity
and default `for:` in its spec (layerwatch/alerts/specs.py); what is here is the wiring: scrape jobs, target
labels, windows, severities, where runbooks and receivers live, the compose stack's addresses.
"""

from __future__ import annotations

from dataclasses import dataclass

from layerwatch import ports

# Scrape jobs. Rules select on these, so a Prometheus scraping layerwatch under other job names
# needs only these strings changed (and the deploy files regenerated).
SHIM_JOB = "layerwatch-shim"
EXPORTER_JOB = "layerwatch-exporter"
VLLM_JOB = "vllm"  # `vllm serve`'s /metrics: its vllm: series, labelled with the served model name
VLLM_GUARD_JOB = "layerwatch-vllm-guard"  # `layerwatch vllm-guard`'s /metrics: the shim's quality-guard series
SHIM_SELECTOR = f'job="{SHIM_JOB}"'
EXPORTER_SELECTOR = f'job="{EXPORTER_JOB}"'
VLLM_SELECTOR = f'job="{VLLM_JOB}"'
# The quality guard's series (shadow checks, gated requests, the shadow rate) come from a shim or a vLLM guard.
QUALITY_GUARD_SELECTOR = f'job=~"{SHIM_JOB}|{VLLM_GUARD_JOB}"'

# Recording rules keep the target labels next to the model, so that an alert names the shim or
# exporter it comes from and Alertmanager can group by it and inhibit on a down target.
TARGET_LABELS = ("job", "instance")

# Windows, in seconds (a rendering for tests may scale them; see layerwatch.alerts.durations.Timing).
RATE_WINDOW = 300.0  # every rate(): 5m
SKIP_BASELINE_WINDOW = 3600.0  # the skip ratio's own recent baseline: 1h
GATE_CHANGE_WINDOW = 3600.0  # how long a gates_sha256 change stays visible (and the alert firing)
QUALITY_GUARD_WINDOW = 900.0  # over which LayerwatchQualityGuardBlind judges that nothing was measured: 15m


@dataclass(frozen=True)
class LatencyObjectives:
    """vLLM's latency objectives (LayerwatchVllmLatencyHigh): a quantile of each per-token latency over
    the rate window. Set them to your service's objectives; the defaults suit a small model on CPU."""

    quantile: float = 0.99
    time_to_first_token_max: float = 2.0  # seconds
    inter_token_latency_max: float = 0.25  # seconds


VLLM_LATENCY_OBJECTIVES = LatencyObjectives()

# Severities: Alertmanager routes critical to the pager, warning to the ticket queue.
SEVERITY_PAGE = "critical"
SEVERITY_TICKET = "warning"

# Each alert links to its section of docs/runbooks.md under this URL (the anchor is the alert's;
# see layerwatch.alerts.specs.AlertSpec.runbook_url).
RUNBOOK_BASE_URL = "https://github.com/layerwatch/layerwatch/blob/main/docs/runbooks.md"

# Alertmanager receivers. The committed deploy file points at placeholders under the reserved
# `.invalid` domain (RFC 2606: they can never resolve), to be replaced by the real pager/ticket
# webhook bridges; tests render their own URLs.
PAGER_URL = "http://pager.invalid/layerwatch"
TICKET_URL = "http://ticket.invalid/layerwatch"

# The shim's mitigation webhook receiver (`layerwatch serve --mitigation-address`, docs/service.md,
# "Alert-driven mitigation"): off (None) by default. To turn it on, set the URL Alertmanager posts to,
# e.g. f"http://shim:{ports.SHIM_MITIGATION_PORT}/alerts", and the shim's bearer token file as
# Alertmanager sees it, then regenerate: every layerwatch alert also goes to the shim.
MITIGATION_URL: str | None = None
MITIGATION_CREDENTIALS_FILE = "/etc/alertmanager/secrets/mitigation.token"

# The docker-compose stack: service addresses and the scrape interval Grafana must agree with.
COMPOSE_SHIM_TARGET = f"shim:{ports.SHIM_HTTP_PORT}"
COMPOSE_EXPORTER_TARGET = f"exporter:{ports.EXPORTER_HTTP_PORT}"
COMPOSE_VLLM_SERVICE = "vllm"  # optional (`docker compose --profile vllm`): found by DNS, on ports.VLLM_HTTP_PORT
COMPOSE_VLLM_GUARD_SERVICE = "vllm-guard"  # its quality guard, the same way, on ports.VLLM_GUARD_PORT
# The name the deployed `vllm serve` serves its model under: vLLM labels its series with it, the plugin
# its gate frames, and the rules pick the profile of that name.
VLLM_SERVED_MODEL_NAME = "smollm2-135m-instruct"
COMPOSE_ALERTMANAGER_TARGET = f"alertmanager:{ports.ALERTMANAGER_PORT}"
COMPOSE_PROMETHEUS_URL = f"http://prometheus:{ports.PROMETHEUS_PORT}"
SCRAPE_INTERVAL = 15.0
EVALUATION_INTERVAL = 15.0
# Long-term storage: Prometheus-compatible stores the compose stack's Prometheus remote-writes every
# sample to, e.g. "http://victoriametrics:8428/api/v1/write" (docs/fleet.md). None by default.
REMOTE_WRITE_URLS: tuple[str, ...] = ()

GRAFANA_DATASOURCE_UID = "layerwatch-prometheus"
GRAFANA_DASHBOARD_DIR = "/var/lib/grafana/dashboards/layerwatch"  # where compose mounts layerwatch/dashboards/json
