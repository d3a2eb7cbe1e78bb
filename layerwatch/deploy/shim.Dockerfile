# The inference shim: `layerwatch serve` with the gated model (torch, CPU build by default).
# Build context: the repository root (see docker-compose.yml).
FROM python:3.11-slim

# torch comes from PyTorch's own index: PyPI's default torch wheel pulls several GB of CUDA
# libraries. CPU by default; for a GPU host pass the CUDA index of your driver, e.g.
# --build-arg TORCH_INDEX_URL=https://download.pytorch.org/whl/cu128 (docker-compose.gpu.yml).
# TORCH_VERSION must equal the `serve` pin in pyproject.toml (tests/stack checks it).
ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu
ARG TORCH_VERSION=2.13.0

ENV PYTHONDONTWRITEBYTECODE=1 PYTHONUNBUFFERED=1 PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1

RUN useradd --create-home --uid 10001 --shell /usr/sbin/nologin layerwatch \
    && pip install --index-url "${TORCH_INDEX_URL}" "torch==${TORCH_VERSION}"

WORKDIR /src
COPY pyproject.toml README.md ./
# What `layerwatch serve` imports: the core, the model runtime and service, and the command line.
COPY layerwatch/*.py layerwatch/py.typed ./layerwatch/
COPY layerwatch/inference_shim ./layerwatch/inference_shim
COPY layerwatch/cli ./layerwatch/cli
RUN pip install ".[serve]" && rm -rf /src

USER layerwatch
WORKDIR /home/layerwatch
EXPOSE 8000
# The readiness probe runs a real decode step and checks that layer activity was recorded.
HEALTHCHECK --interval=15s --timeout=10s --start-period=60s --retries=3 \
    CMD ["python", "-c", "import urllib.request; urllib.request.urlopen('http://127.0.0.1:8000/readyz', timeout=8)"]
# Loopback is the shim's default; in a container it must listen on every interface.
CMD ["layerwatch", "serve", "--host", "0.0.0.0", "--port", "8000"]
