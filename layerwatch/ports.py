"""The default ports of the stack's services (docs/interfaces.md). Every default address and the
compose stack's targets are built from these; services bind to loopback unless told otherwise."""

SHIM_HTTP_PORT = 8000  # `layerwatch serve`: the OpenAI-compatible API, /metrics, /healthz, /readyz
SHIM_MITIGATION_PORT = 8001  # `layerwatch serve --mitigation-address`: Alertmanager's webhook receiver (off by default)
EXPORTER_FRAMES_PORT = 9410  # `layerwatch exporter`: gate frames in, over UDP
EXPORTER_HTTP_PORT = 9411  # `layerwatch exporter`: /metrics and /healthz
PROMETHEUS_PORT = 9090  # Prometheus' own default
ALERTMANAGER_PORT = 9093  # Alertmanager's own default

LOOPBACK = "127.0.0.1"
