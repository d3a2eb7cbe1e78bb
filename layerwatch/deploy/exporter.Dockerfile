# The exporter sidecar: `layerwatch exporter`, and beside vLLM `layerwatch vllm-guard`. A light image: the
# package without the `serve` extra and without inference_shim, so no torch and no model weights (neither
# command imports them). Build context: the repository root.
FROM python:3.11-slim

ENV PYTHONDONTWRITEBYTECODE=1 PYTHONUNBUFFERED=1 PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1

RUN useradd --create-home --uid 10001 --shell /usr/sbin/nologin layerwatch

WORKDIR /src
COPY pyproject.toml README.md ./
# What `layerwatch exporter` and `layerwatch vllm-guard` import: the core, both packages and the command line.
COPY layerwatch/*.py layerwatch/py.typed ./layerwatch/
COPY layerwatch/exporter ./layerwatch/exporter
COPY layerwatch/vllm_guard ./layerwatch/vllm_guard
COPY layerwatch/cli ./layerwatch/cli
RUN pip install ".[vllm-guard]" && rm -rf /src

USER layerwatch
WORKDIR /home/layerwatch
# Gate frames arrive on UDP 9410; /metrics is served on 9411.
EXPOSE 9410/udp 9411
HEALTHCHECK --interval=15s --timeout=5s --start-period=10s --retries=3 \
    CMD ["python", "-c", "import urllib.request; urllib.request.urlopen('http://127.0.0.1:9411/metrics', timeout=4)"]
CMD ["layerwatch", "exporter", "--listen", "0.0.0.0:9410", "--http", "0.0.0.0:9411"]
