# `vllm serve` with layerwatch's plugin (layerwatch/deploy/vllm.py gives the arguments). vLLM's CPU
# release image by default; docker-compose.gpu.yml builds on its CUDA image (VLLM_IMAGE). Keep the tag
# at the vLLM version the plugin is tested with. Build context: the repository root.
ARG VLLM_IMAGE=public.ecr.aws/q9t5s3a7/vllm-cpu-release-repo:v0.32.0
FROM ${VLLM_IMAGE}

ENV PYTHONDONTWRITEBYTECODE=1 PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1

RUN useradd --create-home --uid 10001 --shell /usr/sbin/nologin layerwatch

WORKDIR /src
COPY pyproject.toml README.md ./
COPY layerwatch ./layerwatch
# The package with the plugin's extra only: the image's torch, transformers and vLLM stay as they are.
RUN python3 -m pip install ".[vllm]" && rm -rf /src

USER layerwatch
WORKDIR /home/layerwatch
EXPOSE 8000
ENTRYPOINT ["vllm", "serve"]
