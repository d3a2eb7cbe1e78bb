"""`layerwatch vllm-guard`: vLLM's OpenAI API through the quality guard (layerwatch/vllm_guard), until SIGTERM,
SIGINT or SIGHUP (layerwatch/cli/signals.py), which drain it once it serves."""

from __future__ import annotations

import argparse
import asyncio
import logging
import sys

from layerwatch.cli.signals import STOP_SIGNALS, Stopped
from layerwatch.settings import add_flags, from_flags
from layerwatch.vllm_guard.checker import Checker
from layerwatch.vllm_guard.metrics import GuardMetrics
from layerwatch.vllm_guard.proxy import GuardProxy, run_until_stopped
from layerwatch.vllm_guard.settings import GuardSettings

log = logging.getLogger("layerwatch.vllm_guard")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_flags(parser, GuardSettings)


def run(args: argparse.Namespace) -> int:
    settings: GuardSettings = from_flags(GuardSettings, args)
    logging.basicConfig(
        level=settings.log_level, stream=sys.stderr, format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    metrics = GuardMetrics(settings.served_model_name, settings.shadow_rate)
    checker = Checker(settings.upstream, settings.served_model_name, metrics)
    proxy = GuardProxy(settings.upstream, settings.shadow_rate, metrics, checker)
    host, port = settings.listen
    log.info(
        "serving vLLM at %s on http://%s:%d, checking %g of its answers; /metrics there",
        settings.upstream,
        host,
        port,
        settings.shadow_rate,
    )
    try:
        serving = run_until_stopped(proxy, host, port, settings.drain_timeout_seconds, STOP_SIGNALS)
        signum = asyncio.run(serving)
    except OSError as exc:
        print(f"layerwatch vllm-guard: cannot bind {host}:{port}: {exc}", file=sys.stderr)
        return 1
    finally:
        log.info("stopped")
    raise Stopped(signum)  # main exits by it
