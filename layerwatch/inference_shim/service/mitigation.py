"""Alert-driven mitigation: what `layerwatch serve` does when Alertmanager says its model is unwell.

Alertmanager posts its webhook payload (version 4) to the shim's receiver (mitigation_receiver.py).
When one of MITIGATING_ALERTS fires for the served model (label model_name), a mitigation starts:
the next `requests` requests, for at most `seconds`, are shadow-checked at rate 1 (every one is
compared with the full-depth model, whatever its temperature), or, with `full_depth`, run at full
depth (threshold 0). It ends when the alert resolves or its budget runs out, whichever comes
first (or an operator ends it: DELETE /mitigations on the receiver), or the shim shuts down.
Every start and end is a metric and one log line (MITIGATION_START / MITIGATION_END).

State is kept per (alertname, fingerprint), the alert's identity in Alertmanager, together with the
alert's startsAt, which tells incidents apart: a repeat of a known notification changes nothing,
and a notification older than the known one (deliveries race, Alertmanager retries) is stale. So
every order of deliveries ends in the same state.

New requests ask `Mitigations.for_new_request()` once, at admission: it is the one place that says
whether a request runs mitigated (a per-request depth decision made elsewhere must consult its
`threshold` first). Other reactions to a paging alert (severity critical) of this model register a
callback in `Mitigations.on_paging`; it is called once when such an alert starts firing and once
when it resolves.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from typing import Annotated, Literal

from prometheus_client import CollectorRegistry
from pydantic import AwareDatetime, BaseModel, ConfigDict, Field, ValidationError, field_validator

from layerwatch.inference_shim.service.metrics import make_counter, make_gauge
from layerwatch.logfmt import logfmt_line, logfmt_value

log = logging.getLogger(__name__)

# The alerts that start a mitigation (layerwatch/alerts/specs.py names them; tests/service/test_mitigation.py
# checks that they exist there): the gates' scores drift, skipping became static, or runs away.
MITIGATING_ALERTS = ("LayerwatchEntropyDrift", "LayerwatchRoutingStatic", "LayerwatchRunawaySkipping")
PAGING_SEVERITY = "critical"  # layerwatch/mixin/config.py: SEVERITY_PAGE
MAX_ALERTS_PER_NOTIFICATION = 1000  # the generated config sends at most 100 (max_alerts)
MAX_TRACKED_ALERTS = 1000  # known alerts kept, in effect or not (_evict)
ALERTS_PER_LOCK_HOLD = 25  # Mitigations.apply: a lock hold of 1-2 ms, log lines included
END_REASONS = ("resolved", "requests", "time", "operator", "evicted", "shutdown")
ALERT_OUTCOMES = ("started", "ended", "unchanged", "stale", "other_model", "not_mitigating")
WEBHOOK_OUTCOMES = (
    "accepted",
    "unauthorized",
    "malformed",
    "too_large",
    "not_found",
    "too_many_connections",
    "shutting_down",
)


# --- Alertmanager's webhook payload -----------------------------------------------------------------


class _WebhookAlert(BaseModel):
    model_config = ConfigDict(extra="ignore")

    status: Literal["firing", "resolved"]
    labels: dict[str, Annotated[str, Field(max_length=1024)]] = Field(max_length=64)
    # With a zone, as Alertmanager sends them: a naive time could not be ordered against a known one.
    startsAt: AwareDatetime
    endsAt: AwareDatetime  # validated as version 4 has it; the status says whether it resolved
    fingerprint: str = Field(min_length=1, max_length=64)

    @field_validator("labels")
    @classmethod
    def _named(cls, labels: dict[str, str]) -> dict[str, str]:
        if not labels.get("alertname"):
            raise ValueError("an alert needs the label alertname")
        return labels


class _Webhook(BaseModel):
    model_config = ConfigDict(extra="ignore")

    version: Literal["4"]
    status: Literal["firing", "resolved"]
    alerts: list[_WebhookAlert] = Field(max_length=MAX_ALERTS_PER_NOTIFICATION)


@dataclass(frozen=True)
class AlertNotice:
    """One alert of a webhook notification."""

    alertname: str
    fingerprint: str
    firing: bool
    labels: Mapping[str, str]
    starts_at: datetime


class ShuttingDown(RuntimeError):
    """Mitigations.apply after Mitigations.shut_down: the shim is stopping."""


class MalformedNotification(ValueError):
    """Not Alertmanager's version-4 webhook payload; the message says what is wrong."""


def parse_notification(body: bytes) -> list[AlertNotice]:
    """The alerts of a webhook body. Raises MalformedNotification naming the problem."""
    try:
        webhook = _Webhook.model_validate_json(body)
    except ValidationError as exc:
        # A location names a label as the webhook spelled it: escaped, it cannot forge a log line.
        problems = "; ".join(
            f"{'.'.join(logfmt_value(p) for p in error['loc']) or 'body'}: {error['msg']}" for error in exc.errors()[:5]
        )
        raise MalformedNotification(f"not an Alertmanager version-4 webhook payload: {problems}") from None
    return [
        AlertNotice(a.labels["alertname"], a.fingerprint, a.status == "firing", a.labels, a.startsAt)
        for a in webhook.alerts
    ]


# --- the mitigation state -----------------------------------------------------------------------------

# A mitigation's deadline is a wall-clock datetime (for its log line): 5e9 minutes raised OverflowError
# at the first mitigating alert, which then got no answer and no mitigation. A year is more than any
# incident needs; its alert resolving ends it earlier anyway.
MAX_MITIGATION_MINUTES = 365 * 24 * 60


@dataclass(frozen=True)
class MitigationSettings:
    requests: int  # a mitigation covers at most this many new requests ...
    seconds: float  # ... and lasts at most this long
    full_depth: bool  # mitigated requests run at threshold 0 instead of being shadow-checked
    shadow_rate: float  # --shadow-rate: what requests get outside a mitigation

    def __post_init__(self) -> None:
        if self.requests < 1:
            raise ValueError(f"--mitigation-requests must be >= 1, got {self.requests}")
        if not 0 < self.seconds <= MAX_MITIGATION_MINUTES * 60:  # (written so that NaN fails too)
            raise ValueError(
                f"--mitigation-minutes must be a positive number of at most {MAX_MITIGATION_MINUTES} (a year), "
                f"got {self.seconds / 60:g}"
            )


@dataclass(frozen=True)
class RequestMitigation:
    """What a new request gets from the mitigations in effect when it is admitted."""

    threshold: float | None = None  # its own skip threshold (0.0: full depth); None: the policy's
    shadow_rate: float | None = None  # its shadow check rate; None: --shadow-rate


NO_MITIGATION = RequestMitigation()


@dataclass(frozen=True)
class PagingEvent:
    """A paging alert of this model started firing (firing=True) or resolved."""

    alertname: str
    fingerprint: str
    labels: Mapping[str, str]
    firing: bool


PagingCallback = Callable[[PagingEvent], None]


@dataclass
class _Budget:
    requests_left: int
    deadline: float  # monotonic
    until: datetime  # the deadline on the wall clock, for the log line


@dataclass
class _KnownAlert:
    starts_at: datetime  # which incident of this alert we know of
    firing: bool
    budget: _Budget | None = None  # while its mitigation is in effect
    touched: float = 0.0  # monotonic, for evicting the oldest


class MitigationMetrics:
    def __init__(self, registry: CollectorRegistry, model_name: str) -> None:
        webhook = make_counter("layerwatch_mitigation_webhook_requests_total", registry)
        self.webhook = {outcome: webhook.labels(model_name, outcome) for outcome in WEBHOOK_OUTCOMES}
        alerts = make_counter("layerwatch_mitigation_alerts_total", registry)
        self.alerts = {outcome: alerts.labels(model_name, outcome) for outcome in ALERT_OUTCOMES}
        started = make_counter("layerwatch_mitigations_started_total", registry)
        self.started = {name: started.labels(model_name, name) for name in MITIGATING_ALERTS}
        ended = make_counter("layerwatch_mitigations_ended_total", registry)
        self.ended = {reason: ended.labels(model_name, reason) for reason in END_REASONS}
        self.active = make_gauge("layerwatch_mitigations_active", registry).labels(model_name)
        self.shadow_rate = make_gauge("layerwatch_mitigation_shadow_rate", registry).labels(model_name)
        self.full_depth = make_gauge("layerwatch_mitigation_full_depth", registry).labels(model_name)
        self.requests = make_counter("layerwatch_mitigated_requests_total", registry).labels(model_name)


@dataclass
class Mitigations:
    """The mitigations in effect for one served model; safe to call from any thread."""

    model_name: str
    settings: MitigationSettings
    metrics: MitigationMetrics
    clock: Callable[[], float] = time.monotonic
    on_paging: list[PagingCallback] = field(default_factory=list)  # called outside the lock, in order

    def __post_init__(self) -> None:
        self._lock = threading.Lock()
        self._shut_down = False
        self._known: dict[tuple[str, str], _KnownAlert] = {}
        # At full depth there is nothing gated to check: a full-depth shadow check would always agree.
        self._shadow_rate = 0.0 if self.settings.full_depth else 1.0
        self._mitigated = RequestMitigation(0.0 if self.settings.full_depth else None, self._shadow_rate)
        self._publish()

    def for_new_request(self) -> RequestMitigation:
        """Called once per new request: what it gets; takes one request from every active budget."""
        with self._lock:
            now = self.clock()
            self._expire(now)
            active = self._active()
            if not active:
                return NO_MITIGATION
            self.metrics.requests.inc()
            for key, known, budget in active:
                budget.requests_left -= 1
                if budget.requests_left == 0:
                    self._end(key, known, "requests")
            self._publish()
            return self._mitigated

    def expire(self) -> None:
        """End the mitigations whose time is up (the receiver calls this twice a second)."""
        with self._lock:
            self._expire(self.clock())

    def in_effect(self) -> list[dict]:
        """The mitigations in effect, for an operator (GET /mitigations)."""
        with self._lock:
            self._expire(self.clock())
            return [
                {
                    "alertname": key[0],
                    "fingerprint": key[1],
                    "starts_at": known.starts_at.isoformat(),
                    "requests_left": budget.requests_left,
                    "until": budget.until.isoformat(timespec="seconds"),
                }
                for key, known, budget in self._active()
            ]

    def end_all(self, reason: str = "operator") -> int:
        """End every mitigation now; returns how many. An operator does (DELETE /mitigations): repeats
        of the same incidents do not start them again, a new incident of an alert does."""
        with self._lock:
            return self._end_all(reason)

    def shut_down(self) -> None:
        """End every mitigation (reason "shutdown") and apply no notification after: every
        MITIGATION_START in the log has its MITIGATION_END. A receiver's handler can still be
        reading a body when its listener closes; its apply raises ShuttingDown."""
        with self._lock:
            self._shut_down = True
            self._end_all("shutdown")

    def apply(self, alerts: Sequence[AlertNotice]) -> list[str]:
        """A webhook notification's alerts, in order; returns each one's outcome (ALERT_OUTCOMES).

        ALERTS_PER_LOCK_HOLD at a time: every new request takes the lock, on the API's event loop,
        and a body of 1000 alerts that start mitigations held it for about 45 ms (its log lines
        included). Each alert stands alone, so a request admitted in between sees the earlier ones
        applied, as if Alertmanager had sent them in two notifications. Raises ShuttingDown after
        shut_down, the alerts applied before it stay applied (and ended)."""
        outcomes, events = [], []
        for first in range(0, len(alerts), ALERTS_PER_LOCK_HOLD):
            with self._lock:
                if self._shut_down:
                    raise ShuttingDown("the shim is shutting down")
                now = self.clock()
                self._expire(now)
                for alert in alerts[first : first + ALERTS_PER_LOCK_HOLD]:
                    outcome, event = self._apply(alert, now)
                    self.metrics.alerts[outcome].inc()
                    outcomes.append(outcome)
                    if event is not None:
                        events.append(event)
                self._evict()
                self._publish()
        for event in events:
            for callback in self.on_paging:
                try:
                    callback(event)
                except Exception:  # one reaction failing must not stop the others, nor the mitigation
                    log.exception("paging callback %r failed on %s", callback, event)
        return outcomes

    def _apply(self, alert: AlertNotice, now: float) -> tuple[str, PagingEvent | None]:
        if alert.labels.get("model_name") != self.model_name:
            return "other_model", None
        mitigating = alert.alertname in MITIGATING_ALERTS
        paging = alert.labels.get("severity") == PAGING_SEVERITY
        if not (mitigating or paging):
            return "not_mitigating", None
        key = (alert.alertname, alert.fingerprint)
        known = self._known.get(key)
        outcome, event = "unchanged", None
        if known is not None and alert.starts_at < known.starts_at:
            outcome = "stale"  # an earlier incident's notification, delivered late
        elif known is not None and alert.starts_at == known.starts_at and (alert.firing or not known.firing):
            pass  # a repeat, or a firing delivered after its own resolution
        else:  # news: the first we hear of it, its resolution, or a newer incident of the same alert
            was_firing = known is not None and known.firing
            if known is not None and known.budget is not None:
                self._end(key, known, "resolved")
                outcome = "ended"
            known = self._known[key] = _KnownAlert(alert.starts_at, alert.firing, touched=now)
            if alert.firing and mitigating:
                self._start(key, alert, known, now)
                outcome = "started"
            if paging and alert.firing != was_firing:
                event = PagingEvent(alert.alertname, alert.fingerprint, dict(alert.labels), alert.firing)
        return (outcome if mitigating else "not_mitigating"), event

    def _start(self, key: tuple[str, str], alert: AlertNotice, known: _KnownAlert, now: float) -> None:
        s = self.settings
        until = datetime.now(UTC) + timedelta(seconds=s.seconds)
        known.budget = _Budget(s.requests, now + s.seconds, until)
        self.metrics.started[alert.alertname].inc()
        action = "full_depth" if s.full_depth else "shadow_rate=1"
        log.warning(
            "%s",
            logfmt_line(
                "MITIGATION_START",
                alertname=key[0],
                fingerprint=key[1],
                model=self.model_name,
                action=action,
                requests=s.requests,
                until=until.isoformat(timespec="seconds"),
                starts_at=alert.starts_at.isoformat(),
            ),
        )

    def _end(self, key: tuple[str, str], known: _KnownAlert, reason: str) -> None:
        assert known.budget is not None
        log.warning(
            "%s",
            logfmt_line(
                "MITIGATION_END",
                alertname=key[0],
                fingerprint=key[1],
                model=self.model_name,
                reason=reason,
                requests_left=known.budget.requests_left,
            ),
        )
        known.budget = None
        self.metrics.ended[reason].inc()

    def _end_all(self, reason: str) -> int:
        active = self._active()
        for key, known, _ in active:
            self._end(key, known, reason)
        self._publish()
        return len(active)

    def _expire(self, now: float) -> None:
        expired = [(key, known) for key, known, budget in self._active() if now >= budget.deadline]
        for key, known in expired:
            self._end(key, known, "time")
        if expired:
            self._publish()

    def _active(self) -> list[tuple[tuple[str, str], _KnownAlert, _Budget]]:
        return [(key, known, known.budget) for key, known in self._known.items() if known.budget is not None]

    def _evict(self) -> None:
        """Keep MAX_TRACKED_ALERTS: the inactive heard of longest ago go first; if the mitigations in
        effect alone are too many, those that end soonest are ended (evicted). Each does the same to
        requests, so the newest incidents keep it in effect, and the cost per request stays bounded."""
        excess = len(self._known) - MAX_TRACKED_ALERTS
        if excess <= 0:
            return
        inactive = sorted((k for k, v in self._known.items() if v.budget is None), key=self._touched)
        for key in inactive[:excess]:
            del self._known[key]
        excess -= len(inactive[:excess])
        for key, known, _ in sorted(self._active(), key=lambda active: active[2].deadline)[:excess]:
            self._end(key, known, "evicted")
            del self._known[key]

    def _touched(self, key: tuple[str, str]) -> float:
        return self._known[key].touched

    def _publish(self) -> None:
        active = len(self._active())
        self.metrics.active.set(active)
        self.metrics.shadow_rate.set(self._shadow_rate if active else self.settings.shadow_rate)
        self.metrics.full_depth.set(1 if active and self.settings.full_depth else 0)
