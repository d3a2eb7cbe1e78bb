"""Everything the generated rules, dashboards and deploy files share, in one place.

Thresholds live in the per-model profiles (alerts/profiles/*.yaml); what is here is the wiring:
scrape jobs, windows, default `for:` durations, where runbooks and receivers live.
"""

from __future__ import annotations

# Scrape jobs. Rules select on these, so a Prometheus scraping layerwatch under other job names
# needs only these two strings changed (and the deploy files regenerated).
SHIM_JOB = "layerwatch-shim"
EXPORTER_JOB = "layerwatch-exporter"
SHIM_SELECTOR = f'job="{SHIM_JOB}"'
EXPORTER_SELECTOR = f'job="{EXPORTER_JOB}"'

# Recording rules keep the target labels next to the model, so that an alert names the shim or
# exporter it comes from and Alertmanager can group by it and inhibit on a down target.
TARGET_LABELS = ("job", "instance")

# Windows, in seconds (a rendering for tests may scale them; see alerts.durations.Timing).
RATE_WINDOW = 300.0  # every rate(): 5m
SKIP_BASELINE_WINDOW = 3600.0  # the skip ratio's own recent baseline: 1h
GATE_CHANGE_WINDOW = 3600.0  # how long a gates_sha256 change stays visible (and the alert firing)

# Alert names (CONTRACT) and their default `for:` in seconds. A profile may override the ones
# evaluated per model; the others have no model-specific thresholds.
PER_MODEL_ALERTS: dict[str, float] = {
    "LayerwatchEntropySinglePeak": 600.0,
    "LayerwatchRunawaySkipping": 300.0,
    "LayerwatchSkipRateSurge": 300.0,
    "LayerwatchEntropyMeanOutOfBand": 900.0,
    "LayerwatchEntropySpreadOutOfBand": 900.0,
    "LayerwatchZeroEntropyRatioHigh": 600.0,
    "LayerwatchEntropyDrift": 300.0,  # the field's "stays above 0.18 for 5 minutes"
    "LayerwatchShadowAgreementLow": 600.0,
    "LayerwatchTelemetryLoss": 600.0,
}
COMMON_ALERTS: dict[str, float] = {
    "LayerwatchGateWeightsChanged": 0.0,  # a change is an event: notify at once
    "LayerwatchTargetDown": 120.0,
    # Not in the CONTRACT (an addition): a gate file replaced on disk that the shim refused to load.
    "LayerwatchGateFileRejected": 300.0,
}
ALERT_NAMES: tuple[str, ...] = (*PER_MODEL_ALERTS, *COMMON_ALERTS)

SEVERITY_PAGE = "critical"
SEVERITY_TICKET = "warning"

# Each alert links to its section of docs/runbooks.md; the anchor is the alert name in lower case
# (the heading is the alert name), which is how GitHub renders heading anchors.
RUNBOOK_BASE_URL = "https://github.com/layerwatch/layerwatch/blob/main/docs/runbooks.md"


def runbook_url(alert_name: str) -> str:
    return f"{RUNBOOK_BASE_URL}#{alert_name.lower()}"


# Alertmanager receivers. The committed deploy file points at placeholders under the reserved
# `.invalid` domain (RFC 2606: they can never resolve), to be replaced by the real pager/ticket
# webhook bridges; tests render their own URLs.
PAGER_URL = "http://pager.invalid/layerwatch"
TICKET_URL = "http://ticket.invalid/layerwatch"

# The docker-compose stack: service addresses and the scrape interval Grafana must agree with.
COMPOSE_SHIM_TARGET = "shim:8000"
COMPOSE_EXPORTER_TARGET = "exporter:9411"
COMPOSE_ALERTMANAGER_TARGET = "alertmanager:9093"
COMPOSE_PROMETHEUS_URL = "http://prometheus:9090"
SCRAPE_INTERVAL = 15.0
EVALUATION_INTERVAL = 15.0

GRAFANA_DATASOURCE_UID = "layerwatch-prometheus"
GRAFANA_DASHBOARD_DIR = "/var/lib/grafana/dashboards/layerwatch"  # where compose mounts dashboards/json
