"""What Prometheus and Alertmanager say about each model, as lines of text for the terminal view.

Per model: the alerts Prometheus holds pending or firing (`/api/v1/alerts`), the last
notifications Alertmanager delivered to the demo's receiver (layerwatch/demo/receiver.py) with their age, and
every figure a page reads next to its profile limit (layerwatch/alerts/signals.py). `layerwatch demo` and
`layerwatch top --prometheus` show it beside the exporter's histogram (layerwatch/exporter/live_view.py).
"""

from __future__ import annotations

import json
import math
import time
import urllib.parse
from dataclasses import dataclass, field
from datetime import datetime

from layerwatch import http_get
from layerwatch.alerts.durations import Timing
from layerwatch.alerts.profile import Profile
from layerwatch.alerts.recorded import Recorded
from layerwatch.alerts.signals import Figure, figures_for
from layerwatch.demo.receiver import Notification, WebhookReceiver
from layerwatch.mixin import config

NOTIFICATIONS_SHOWN = 5
TIMEOUT = 3.0  # seconds per Prometheus request: a slow one must not freeze the view
MAX_ANSWER_BYTES = 16 << 20  # an endless answer must not grow the view without bound
TARGET_DOWN = "LayerwatchTargetDown"
# Before the alert's name, not after it: at the end of a row (80 to 108 columns) a terminal of 80 cut it off.
PAST = "← past the limit of "
RESTART_NOTE = "expected: the drill's restart"


@dataclass(frozen=True)
class PrometheusAlert:
    name: str
    state: str  # pending | firing
    labels: dict[str, str]
    active_for: float | None  # seconds since it became active


@dataclass
class Snapshot:
    """One read of Prometheus (and the receiver), rendered per model by `lines`."""

    prometheus_url: str
    alerts: list[PrometheusAlert] = field(default_factory=list)
    figures: dict[tuple[str, str], float | None] = field(default_factory=dict)  # (model, label) -> value
    notifications: list[Notification] | None = None  # None: no receiver to read (`top`)
    error: str | None = None
    profiles: dict[str, Profile] = field(default_factory=dict)
    taken_at: float = field(default_factory=time.monotonic)
    window: str = "5m"  # the rules' rate window, which the rate figures cover
    # A restart the demo made on purpose: (the target's instance, when it began, monotonic). Its
    # LayerwatchTargetDown is the restart's, not news: marked so.
    restart: tuple[str, float] | None = None

    def lines(self, model: str) -> list[str]:
        if self.error is not None:
            return [f"Prometheus {self.prometheus_url}: not readable ({self.error})"]
        return self._alert_lines(model) + self._notifications(model) + self._figure_lines(model)

    def compact_lines(self, model: str) -> list[str]:
        """`lines` for a short terminal, which shows their top: the figures before the notifications (what
        fires now before what was sent), and the rows past their limit first. In 80 × 24 the runaway drill's
        screen ended at the table's heading, no figure of the alerts firing above it in sight."""
        if self.error is not None:
            return self.lines(model)
        figures = self._figure_lines(model)
        heading, rows = figures[:2], sorted(figures[2:], key=lambda row: PAST not in row)  # stable sort
        return self._alert_lines(model) + heading + rows + self._notifications(model)

    def _notifications(self, model: str) -> list[str]:
        return [] if self.notifications is None else self._notification_lines(self.notifications, model)

    def _alert_lines(self, model: str) -> list[str]:
        mine = [a for a in self.alerts if a.labels.get("model_name", model) == model]
        lines = [f"alerts in Prometheus ({len(mine)} pending or firing; for how long)"]
        for alert in sorted(mine, key=lambda a: (a.state != "firing", a.name)):
            # Which rule of the alert fired; for an alert of no model (a target down), the target.
            target = "" if "model_name" in alert.labels else alert.labels.get("instance", "")
            detail = alert.labels.get("trigger", target)
            began = None if alert.active_for is None else self.taken_at - alert.active_for
            if began is not None and self._restarted(alert.name, alert.labels, began):
                detail = f"({RESTART_NOTE}) {detail}"  # first: after the target it began past the 80th column
            lines.append(
                f"  {alert.state.upper():8} {_age(alert.active_for):>4}  {alert.name:33} "
                f"{alert.labels.get('severity', ''):9}{detail}".rstrip()
            )
        return lines

    def _restarted(self, name: str, labels: dict[str, str], began: float) -> bool:
        """A target down that began once the demo's own restart of that target had."""
        if self.restart is None or name != TARGET_DOWN:
            return False
        instance, at = self.restart
        return labels.get("instance") == instance and began >= at - 1.0  # 1 s: Prometheus' activeAt is rounded

    def _notification_lines(self, notifications: list[Notification], model: str) -> list[str]:
        lines = ["notifications delivered (Alertmanager → this demo's receiver)"]
        shown = 0
        for notification in notifications:
            alerts = [
                f"{name}"
                + ("" if status == "firing" else f" ({status})")
                + (f" ({RESTART_NOTE})" if self._restarted(name, labels, notification.received_at) else "")
                for name, status, labels in notification.alerts()
                if labels.get("model_name", model) == model
            ]
            if alerts and shown < NOTIFICATIONS_SHOWN:
                age = _age(self.taken_at - notification.received_at)
                lines.append(f"  {age:>4} ago  {notification.receiver.strip('/'):6} {', '.join(sorted(set(alerts)))}")
                shown += 1
        if not shown:
            lines.append("  none yet")
        return lines

    def _figure_lines(self, model: str) -> list[str]:
        profile = self.profiles.get(model)
        if profile is None:
            return [f"no profile for {model}: no limits to show"]
        lines = [
            f"what the pages read (rates: last {self.window}; routing, peaks: the exporter's window)",
            f"  {'':27} {'now':>6}  limit",
        ]
        for figure in figures_for(profile):
            value = self.figures.get((model, figure.label))
            shown = "-" if value is None else figure.show(value)
            if figure.limit is None:
                lines.append(f"  {figure.label:27} {shown:>6}  {'none':8} (no alert reads it: context)")
                continue
            limit = f"{'≥' if figure.fires_below else '≤'} {figure.show(figure.limit(profile))}"
            alert = f"{figure.alert} ({figure.trigger})" if figure.trigger else f"{figure.alert}"
            mark = PAST if value is not None and figure.breached(value, profile) else ""
            lines.append(f"  {figure.label:27} {shown:>6}  {limit:8} {mark}{alert}")
        return lines


class AlertView:
    """Reads Prometheus (and a demo's receiver) for every refresh of the terminal view."""

    def __init__(
        self,
        prometheus_url: str,
        profiles: list[Profile],
        timing: Timing = Timing(),
        receiver: WebhookReceiver | None = None,
    ) -> None:
        self.prometheus_url = prometheus_url.rstrip("/")
        self.profiles = {p.model_name: p for p in profiles}
        self.recorded = Recorded.for_timing(timing)
        self.window = timing(config.RATE_WINDOW)
        self.receiver = receiver
        self.restart: tuple[str, float] | None = None

    def expected_static(self, model: str) -> list[int] | None:
        """The static layers `model`'s healthy profile expects (None: no profile)."""
        profile = self.profiles.get(model)
        return None if profile is None else list(profile.routing.static_layers)

    def restarting(self, instance: str, since: float) -> None:
        """The demo restarts the target `instance` on purpose from `since` (monotonic): its
        LayerwatchTargetDown is marked as the restart's."""
        self.restart = (instance, since)

    def snapshot(self, models: list[str] | None = None) -> Snapshot:
        """Prometheus' alerts and the figures of `models` (default: every model with a profile)."""
        snap = Snapshot(self.prometheus_url, profiles=self.profiles, window=self.window, restart=self.restart)
        if self.receiver is not None:
            snap.notifications = self.receiver.latest(50)
        try:
            snap.alerts = self._alerts()
            for model in self.profiles if models is None else models:
                profile = self.profiles.get(model)
                if profile is not None:
                    for figure in figures_for(profile):
                        snap.figures[(model, figure.label)] = self._value(figure, profile)
        except (OSError, ValueError) as exc:
            snap.error = str(exc)
        return snap

    def _alerts(self) -> list[PrometheusAlert]:
        now = time.time()
        try:
            return [
                PrometheusAlert(a["labels"]["alertname"], a["state"], a["labels"], _since(a.get("activeAt"), now))
                for a in self._api("/api/v1/alerts")["alerts"]
                if a.get("state") in ("pending", "firing")
            ]
        except (LookupError, TypeError, AttributeError):
            raise ValueError("/api/v1/alerts: an alert without its labels, alertname or state") from None

    def _value(self, figure: Figure, profile: Profile) -> float | None:
        result = self._api("/api/v1/query", query=figure.query(self.recorded, profile))["result"]
        if not result:
            return None
        try:
            value = float(result[0]["value"][1])
        except (LookupError, TypeError):
            raise ValueError(f"/api/v1/query: not a sample ({str(result[0])[:80]})") from None
        return None if math.isnan(value) else value

    def _api(self, path: str, **params: str) -> dict:
        query = f"?{urllib.parse.urlencode(params)}" if params else ""
        url = f"{self.prometheus_url}{path}{query}"
        try:  # the whole exchange within TIMEOUT (layerwatch/http_get.py): a trickling answer held the view
            answer = http_get.get(url, TIMEOUT, MAX_ANSWER_BYTES, "application/json")
            if answer.status != 200:
                raise ValueError(f"HTTP {answer.status}")
            body = json.loads(answer.body)
        except (ValueError, TimeoutError) as exc:  # BadAnswer, a size or a JSON error are ValueErrors
            raise ValueError(f"{path}: {exc}") from None
        # Alertmanager answers /api/v1/alerts too (its v1 API, 0.25), with a list: `top --prometheus` given
        # the Alertmanager the demo prints below Prometheus was a TypeError traceback.
        if not isinstance(body, dict) or not isinstance(body.get("data", {}), dict):
            raise ValueError(f"{path}: not an answer of Prometheus' API (is this Prometheus?)")
        if body.get("status") != "success":
            raise ValueError(f"{path}: {body.get('error', body)}")
        return body["data"]


def _since(active_at: str | None, now: float) -> float | None:
    if not active_at:
        return None
    try:  # RFC 3339 with nanoseconds; datetime takes microseconds
        head, _, fraction = active_at.rstrip("Z").partition(".")
        stamp = datetime.fromisoformat(f"{head}.{(fraction or '0')[:6]}+00:00")
    except ValueError:
        return None
    return max(0.0, now - stamp.timestamp())


def _age(seconds: float | None) -> str:
    if seconds is None:
        return "-"
    return f"{seconds:.0f}s" if seconds < 120 else f"{seconds / 60:.0f}m"
