"""The guard's /metrics: the shim's series the quality pages read (docs/metrics.md), under the same names, labels and
help, so that the rules and dashboards read a vLLM-served model's quality guard as they read the shim's."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter

from layerwatch import prometheus
from layerwatch.catalog import SHIM
from layerwatch.vllm_guard.comparison import ShadowFigures

# The plugin applies the served τ to every sequence: each generation request vLLM ran is a gated one (at τ 0 it
# runs at full depth, and its checks say so: agreement 1, no cost).
GATED_MODE, GATED_REASON = "gated", "default"
# The outcomes a sampled sequence can have here (no complexity pre-check: never full_depth).
OUTCOMES = ("checked", "queue_full", "failed", "no_output")


class GuardMetrics:
    def __init__(self, model_name: str, shadow_rate: float) -> None:
        self.registry = CollectorRegistry()

        def counter(name: str, *labels: str) -> Counter:
            return prometheus.counter(name, self.registry, SHIM).labels(model_name, *labels)

        self.tokens = counter("layerwatch_shadow_tokens_total")
        self.agreements = counter("layerwatch_shadow_agreements_total")
        self.kl_nats = counter("layerwatch_shadow_kl_nats_total")
        self.reverse_kl_nats = counter("layerwatch_shadow_reverse_kl_nats_total")
        requests = prometheus.counter("layerwatch_shadow_requests_total", self.registry, SHIM)
        self.outcomes = {outcome: requests.labels(model_name, outcome) for outcome in OUTCOMES}
        self.gated = counter("layerwatch_depth_decisions_total", GATED_MODE, GATED_REASON)
        rate = prometheus.gauge("layerwatch_mitigation_shadow_rate", self.registry, SHIM)
        rate.labels(model_name).set(shadow_rate)

    def gated_request(self) -> None:
        self.gated.inc()

    def not_checked(self, outcome: str) -> None:
        self.outcomes[outcome].inc()

    def checked(self, figures: ShadowFigures) -> None:
        self.tokens.inc(figures.tokens)
        self.agreements.inc(figures.agreements)
        self.kl_nats.inc(figures.kl_nats)
        self.reverse_kl_nats.inc(figures.reverse_kl_nats)
        self.outcomes["checked"].inc()
